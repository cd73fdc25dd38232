// Shared by every k4 kernel: what a kernel file includes to get the generic device helpers
// (device.cuh), the memory layouts of quantized weights and of q8 x (quant_layouts.cuh) and the
// per-type decoders (decoders.cuh). The headers compile under NVRTC (CuPy, the run-time
// compiler) and nvcc alike, so they include no system header; the numbers shared with Python
// come from runtime/cuda/constants.py as -D defines (constants.cuh).
#pragma once
#include "constants.cuh"
#include "device.cuh"
#include "quant_layouts.cuh"
#include "decoders.cuh"
