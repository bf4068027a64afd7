"""The kernels themselves (imported on first use: importing numba.cuda is slow).

``cuda`` must be a module global here: numba's simulator swaps the global
``cuda`` of kernel functions for its fake module.
"""
from numba import cuda


@cuda.jit
def touch_kernel(arr, stride, value):
    # Thread i writes element i*stride: one touch per page when stride = page/itemsize.
    i = cuda.grid(1)
    j = i * stride
    if j < arr.shape[0]:
        arr[j] = arr[j] + value


@cuda.jit
def triad_kernel(a, b, c, scalar):
    start = cuda.grid(1)
    step = cuda.gridsize(1)
    for i in range(start, a.shape[0], step):
        a[i] = b[i] + scalar * c[i]


@cuda.jit
def copy_kernel(dst, src):
    start = cuda.grid(1)
    step = cuda.gridsize(1)
    for i in range(start, dst.shape[0], step):
        dst[i] = src[i]
