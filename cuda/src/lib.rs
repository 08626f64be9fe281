//! Typed access to a CUDA device through cudarc (dynamic loading; NVRTC at run time).
