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
