"""The one door to the native code (``ktquest._C``): every call into C++ goes through a module of this package,
which checks its arguments once (``args.py``) and hands raw arrays to the binding. Nothing else in ktquest
imports ``_C``.

    args.py       the argument checks (dtype, shape, contiguity, device) in front of the calls
    enums.py      the store's enums and the kernels' constants, named by C++ (no torch: the config reads them)
    cpu.py        the CPU's features, the forced scalar kernels, the C heap's prefill settings
    matrix.py     GGUF-encoded matrices: GEMV, int8 GEMM, dequantization
    store.py      the paged KV store: append, read, select, attend
    sizes.py      the bytes a store of a config reserves
    ada.py        Ada-KV's split of a budget over KV heads
    attention.py  the dense decode attention
    plans.py      a whole decode token planned by a cache and run in one call
    decode.py     the CPU decode step of one token (llama2.c's ``transformer(token, pos)``)
    sample.py     logits -> the next token
"""
