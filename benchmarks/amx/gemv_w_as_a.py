"""Drive gemv_w_as_a.cpp (see there) against quant_linear_bf16 on the bundled model's Q4_1 matmuls: the same bits, and
the time of each at one row, the two alternating in one process (issue 17, twenty-fifth part).

    g++ -O2 -march=native -shared -fPIC -o /tmp/gemv_w_as_a.so benchmarks/amx/gemv_w_as_a.cpp
    .venv/bin/python benchmarks/amx/gemv_w_as_a.py /tmp/gemv_w_as_a.so [threads]
"""

import ctypes
import statistics
import sys
import time

import gguf
import torch

from pagedserve.kernels import load_extension
from pagedserve.model.loader import bundled_model_path


def main() -> None:
    lib = ctypes.CDLL(sys.argv[1])
    if lib.amx_init():
        raise SystemExit("no AMX tile state granted")
    torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
    ext = load_extension("native")
    ext.set_amx(True)
    shapes = {}
    for t in gguf.GGUFReader(bundled_model_path()).tensors:
        if t.tensor_type.name == "Q4_1":
            shapes.setdefault(tuple(int(v) for v in t.shape), t)
    for (k, n), t in shapes.items():
        compare(lib, ext, ext.quant_pack(torch.from_numpy(t.data.copy()).view(torch.uint8).reshape(n, -1), 3), n, k)


def compare(lib, ext, packed, n: int, k: int) -> None:
    x = torch.randn(1, k).bfloat16()
    ref = ext.quant_linear_bf16(x, packed, 3, n, k, None, torch.float32)
    y = torch.empty(1, n)

    def proto():
        lib.gemv_rows(3, ctypes.c_void_p(x.data_ptr()), 1, ctypes.c_void_p(packed[0].data_ptr()),
                      ctypes.c_int64(n), ctypes.c_int64(k), ctypes.c_void_p(y.data_ptr()))

    def current():
        ext.quant_linear_bf16(x, packed, 3, n, k, None, torch.float32)

    proto()
    same = torch.equal(ref.view(torch.int32), y.view(torch.int32))
    times = [[], []]
    for _ in range(7):
        for i, f in enumerate((current, proto)):
            f()
            t0 = time.perf_counter()
            for _ in range(50):
                f()
            times[i].append((time.perf_counter() - t0) / 50)
    print(f"Q4_1 {n} x {k}, 1 row: same bits {same}; quant_linear_bf16 {statistics.median(times[0]) * 1e6:.1f} us, "
          f"W as A {statistics.median(times[1]) * 1e6:.1f} us")

if __name__ == "__main__":
    main()
