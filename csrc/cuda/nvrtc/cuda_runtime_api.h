// NVRTC stand-in for <cuda_runtime_api.h> (see README.md): NVRTC declares the device built-ins itself,
// and the runtime API is used only by host code, which is fenced off from NVRTC.
#pragma once
