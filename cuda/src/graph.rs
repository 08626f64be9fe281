use std::sync::Arc;

use cudarc::driver::sys::{CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaEvent, CudaGraph, CudaStream};

use crate::device::Device;
use crate::error::CudaError;

/// An instantiated CUDA graph: the work one [`Device::capture`] recorded, replayable on the
/// device's stream. Buffers it reads and writes are fixed at capture; change their contents,
/// not their addresses, between replays.
pub struct Graph {
    graph: CudaGraph,
}

impl std::fmt::Debug for Graph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Graph")
    }
}

impl Graph {
    /// Moves the graph's resources to the device ahead of the first launch.
    pub fn upload(&self) -> Result<(), CudaError> {
        self.graph
            .upload()
            .map_err(CudaError::driver("cuGraphUpload"))
    }

    /// Enqueues one replay on the device's stream; returns without waiting.
    pub fn launch(&self) -> Result<(), CudaError> {
        self.graph
            .launch()
            .map_err(CudaError::driver("cuGraphLaunch"))
    }
}

/// Ends a capture that the closure left by error or panic, so the stream is usable again.
struct CaptureGuard<'a> {
    stream: &'a Arc<CudaStream>,
    armed: bool,
}

impl Drop for CaptureGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            let _ = self.stream.end_capture(CUgraphInstantiate_flags(0));
        }
    }
}

impl Device {
    /// Records the work `record` enqueues on this device (launches, device-to-device copies,
    /// memsets, cuBLAS calls) into a graph instead of running it.
    ///
    /// Inside `record` nothing may wait on the host: no synchronize, no download, no upload
    /// from host memory. Capture mode is thread-local, so other threads are unaffected.
    pub fn capture(
        &self,
        record: impl FnOnce(&Device) -> Result<(), CudaError>,
    ) -> Result<Graph, CudaError> {
        let stream = self.stream();
        stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(CudaError::driver("cuStreamBeginCapture"))?;
        let mut guard = CaptureGuard {
            stream,
            armed: true,
        };
        let recorded = record(self);
        guard.armed = false;
        let ended = stream.end_capture(CUgraphInstantiate_flags(0));
        // The closure's own error explains an invalidated capture better than end_capture's.
        recorded?;
        match ended.map_err(CudaError::driver("cuStreamEndCapture/cuGraphInstantiate"))? {
            Some(graph) => Ok(Graph { graph }),
            None => Err(CudaError::EmptyCapture),
        }
    }
}

/// GPU-side elapsed time between two points of the device's stream (CUDA events).
pub struct Timer {
    stream: Arc<CudaStream>,
    start: CudaEvent,
    stop: CudaEvent,
}

impl std::fmt::Debug for Timer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Timer")
    }
}

impl Timer {
    pub fn new(device: &Device) -> Result<Timer, CudaError> {
        let ctx = device.context();
        let event = || {
            ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(CudaError::driver("cuEventCreate"))
        };
        Ok(Timer {
            stream: device.stream().clone(),
            start: event()?,
            stop: event()?,
        })
    }

    /// Marks the start at the current end of the stream.
    pub fn start(&self) -> Result<(), CudaError> {
        self.start
            .record(&self.stream)
            .map_err(CudaError::driver("cuEventRecord"))
    }

    /// Marks the stop, waits for it, and returns milliseconds since the last [`Timer::start`].
    pub fn stop(&self) -> Result<f32, CudaError> {
        self.stop
            .record(&self.stream)
            .map_err(CudaError::driver("cuEventRecord"))?;
        self.stop
            .synchronize()
            .map_err(CudaError::driver("cuEventSynchronize"))?;
        self.start
            .elapsed_ms(&self.stop)
            .map_err(CudaError::driver("cuEventElapsedTime"))
    }
}

/// Events recorded at chosen points of the stream, for the device time between consecutive
/// points (a per-kernel profile of one eagerly enqueued step).
pub struct EventTrail {
    stream: Arc<CudaStream>,
    events: Vec<CudaEvent>,
}

impl std::fmt::Debug for EventTrail {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "EventTrail({} events)", self.events.len())
    }
}

impl EventTrail {
    /// `points` events, none recorded yet.
    pub fn new(device: &Device, points: usize) -> Result<EventTrail, CudaError> {
        let ctx = device.context();
        let events = (0..points)
            .map(|_| {
                ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                    .map_err(CudaError::driver("cuEventCreate"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(EventTrail {
            stream: device.stream().clone(),
            events,
        })
    }

    /// Records point `i` at the current end of the stream.
    pub fn mark(&self, i: usize) -> Result<(), CudaError> {
        let event = self.events.get(i).ok_or(CudaError::OutOfBounds {
            what: "event trail",
            start: i,
            end: i + 1,
            size: self.events.len(),
        })?;
        event
            .record(&self.stream)
            .map_err(CudaError::driver("cuEventRecord"))
    }

    /// Waits for the last point and returns the milliseconds between each pair of consecutive
    /// points (every point must have been marked).
    pub fn intervals_ms(&self) -> Result<Vec<f32>, CudaError> {
        let Some(last) = self.events.last() else {
            return Ok(Vec::new());
        };
        last.synchronize()
            .map_err(CudaError::driver("cuEventSynchronize"))?;
        self.events
            .windows(2)
            .map(|w| {
                w[0].elapsed_ms(&w[1])
                    .map_err(CudaError::driver("cuEventElapsedTime"))
            })
            .collect()
    }
}

/// The source of [`Device::stall`]'s kernel.
pub const STALL_CU: &str = r#"
extern "C" __global__ void stall_stream(unsigned long long ns) {
    PDL_ENTER();
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        __nanosleep(1000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < ns);
}
"#;

impl Device {
    /// Holds the stream for `micros` microseconds on the device (one thread sleeping), so that
    /// the host can enqueue a whole step behind it and the step then runs back to back, as a
    /// replayed graph would, instead of at the pace of host submission.
    pub fn stall(&self, kernels: &crate::KernelCache, micros: u64) -> Result<(), CudaError> {
        let k = kernels
            .get("stall.cu", STALL_CU, &["stall_stream"])?
            .kernel("stall_stream")?;
        // SAFETY: one scalar argument matching `unsigned long long ns`; no memory is touched.
        unsafe { self.launch(&k).arg(micros * 1000).enqueue() }
    }
}
