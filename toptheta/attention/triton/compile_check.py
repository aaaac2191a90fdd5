"""Compile every Triton kernel variant for a GPU target without a GPU, and check its shared memory.

The interpreter (TRITON_INTERPRET=1) runs the kernels' arithmetic but not the compiler: globals a kernel may
not read, type mismatches between branches of a dynamic ``if``, tile shapes tl.dot refuses, shared memory.
This lowers each kernel through TTIR → TTGIR → PTX → cubin with the ptxas shipped in the triton wheel.

    TRITON_INTERPRET=0 python -m toptheta.attention.triton.compile_check [--quick] [--arch 90]

About 10 s of CPU per variant; ``--quick`` compiles one pre- and one post-softmax Top-θ variant and one skip-softmax
variant per kernel and dtype, and a post-softmax boundary (Top-k, top-p) variant of the decode launches (30 kernels).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

SHARED_LIMIT = 227 * 1024  # bytes of shared memory per block on sm_90 (H100/H200)
_POINTERS = {"KS_ptr": "*i32", "KE_ptr": "*i32", "QO_ptr": "*i32", "KEPT_ptr": "*i32", "VROWS_ptr": "*i32",
             "TILES_ptr": "*i32", "SKIP_ptr": "*i32", "EMPTY_ptr": "*i8", "CNT_ptr": "*i32", "VR_ptr": "*i32",
             "TILES_OUT_ptr": "*i32", "SKIP_OUT_ptr": "*i32", "STATS_ptr": "*fp64", "N_ptr": "*i32",
             "LAST_ptr": "*i32"}
_DTYPES = {"float32": "*fp32", "float16": "*fp16", "bfloat16": "*bf16"}


def compile_kernel(kernel, dtype: str, constexprs: dict, arch: int = 90, num_warps: int = 4, num_stages: int = 2):
    """The compiled kernel (``.metadata.shared`` in bytes) for inputs of ``dtype``."""
    import triton  # triton: heavy and optional
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    constexprs = {k: v for k, v in constexprs.items() if k in names}  # a kernel takes the settings it declares
    signature = {}
    for name in names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in ("Q_ptr", "K_ptr", "V_ptr", "O_ptr"):
            signature[name] = _DTYPES[dtype]
        elif name == "THETA_ptr" and constexprs.get("SKIP"):
            signature[name] = "*fp64"  # skip-softmax's ln(λ/n) per row
        elif name.endswith("_ptr"):
            signature[name] = _POINTERS.get(name, "*fp32")
        else:
            signature[name] = "fp32" if name in ("scaling", "sdc_scale") else "i32"
    src = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def variants(quick: bool):
    """(kernel name, dtype, constexprs) of every variant worth compiling separately."""
    # (post, SDC mode, keep-max, skip-softmax, a boundary rule: Top-k, top-p (decode only))
    modes = [(False, 1, True, False, False), (True, 0, True, False, False), (True, 0, True, True, False),
             (True, 0, True, False, True)] if quick else (
        [(False, sdc, keep_max, False, False) for sdc in range(4) for keep_max in (True, False)]
        + [(True, 0, True, False, False), (True, 0, False, False, False), (False, 1, True, True, False),
           (True, 0, True, True, False), (False, 1, True, False, True), (True, 0, True, False, True)])
    for dtype, (post, sdc, keep_max, skip, ranked) in itertools.product(("float32", "bfloat16"), modes):
        ieee = dtype == "float32"
        common = dict(POST=post, SDC=sdc, VMC=True, KEEP_MAX=keep_max, UNIFORM=not (keep_max or post or sdc),
                      CAUSAL=True, SCALE_Q=ieee, IEEE=ieee, BLOCK_D=128, BLOCK_DV=128, STATS=True, SPARSE=True, VSUM=False,
                      SKIP_TILES=True, SKIP=skip, RANKED=ranked)
        wide = 32 if ieee else 64  # the wrappers' default tiles
        if not ranked:  # Top-k's and top-p's prefill is the plain kernel's
            yield "prefill", dtype, dict(common, BLOCK_M=wide, BLOCK_N=wide)
        for part in ("logits", "select", "finish"):  # the decode step's three launches
            yield f"decode_{part}", dtype, dict(common, GP=4, QP=4, NSP=64, BLOCK_N=64)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--arch", type=int, default=90)
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET (or set it to 0): the interpreter compiles nothing", file=sys.stderr)
        return 2
    from . import decode, prefill  # triton: heavy; kernels decorated after the TRITON_INTERPRET check

    kernels = {"prefill": prefill._prefill_kernel, "decode_logits": decode._decode_logits,
               "decode_select": decode._decode_select, "decode_finish": decode._decode_finish}
    failed = 0
    for name, dtype, constexprs in variants(args.quick):
        label = f"{name} {dtype} {'post' if constexprs['POST'] else 'pre'} sdc={constexprs['SDC']} " \
                f"keep_max={constexprs['KEEP_MAX']}{' skip-softmax' if constexprs['SKIP'] else ''}" \
                f"{' top-k/top-p' if constexprs['RANKED'] else ''}"
        try:
            shared = compile_kernel(kernels[name], dtype, constexprs, arch=args.arch).metadata.shared
        except Exception as error:  # report every variant, then fail
            failed += 1
            print(f"FAIL {label}: {error!r}"[:4000])
            continue
        ok = shared <= SHARED_LIMIT
        failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {label}: {shared} bytes of shared memory")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
