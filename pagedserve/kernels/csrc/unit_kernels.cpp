// Translation unit 1 of 2 of the extension. Every kernel source includes torch/extension.h, whose parsing
// costs about 50 s of the ~55 s each file took alone; compiling the sources in two units (built in
// parallel) instead of seven cuts a build from about 200 s to about 75 s on 2 cores.
#include "attention.cpp"
#include "ops.cpp"
#include "gguf_gemv.cpp"
#include "decode_stack.cpp"
