// Translation unit 2 of 2 of the extension (see unit_kernels.cpp): the matmuls and the Python bindings.
#include "fixed_gemm.cpp"
#include "quant_gemm.cpp"
#include "bindings.cpp"
