"""Where a kernel's first-use build time goes, on a machine with nvcc and no GPU needed.

    python lab/compile_time.py one fwd --problem golden       # one kernel, phases, in this process
    python lab/compile_time.py first-use --problem golden     # a first use: get_kernel's parallel build
    python lab/compile_time.py imports                        # the imports a worker pays

Each run points TileLang's and flashsink's caches at fresh temporary directories first (set before
anything imports tilelang), so nothing is loaded from an earlier build. ``one`` wraps the phases of
``compile.compile_kernel`` with timers (the kernel's PrimFunc, the cache key, TileLang's lowering,
CUDA source generation, nvcc and the host library, the disk-cache store) and records every
subprocess it starts (nvcc, the host compiler) with its wall time; ``--keep DIR`` keeps the CUDA
source and nvcc command there for a by-hand ``nvcc --time``. ``--hash`` prints the sha256 of the
cubin and of its SASS (``cuobjdump -sass``) so a change meant to leave the device code alone can be
checked. ``first-use`` times ``registry._build_config`` (what the first ``get_kernel`` of a
configuration runs): the kernels it needs are built in worker processes, then loaded.
Run one measurement at a time: parallel runs distort each other.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time

PROBLEMS = {
    # name: dtype, D, groups, precision  (the lab/first_use.py problems' static configuration)
    "golden": ("float16", 128, 8, "fast"),
    "gptoss": ("bfloat16", 64, 8, "fast"),
}

T0 = time.perf_counter()


def _fresh_caches(keep: str | None = None) -> str:
    root = tempfile.mkdtemp(prefix="flashsink-compile-time-")
    os.environ["TILELANG_CACHE_DIR"] = os.path.join(root, "tilelang")
    os.environ["FLASHSINK_CACHE_DIR"] = os.path.join(root, "flashsink")
    os.environ.setdefault("FLASHSINK_LOG", "warning")
    return root


def _cfg(problem: str, arch: str):
    from flashsink.kernel_config import KernelConfig

    dtype, d, g, prec = PROBLEMS[problem]
    return KernelConfig(arch=arch, dtype=dtype, head_dim=d, head_dim_v=d, groups=g, causal=True, has_sinks=True,
                        layout="bhsd", precision=prec, deterministic=False)


class Phases:
    """Accumulated wall seconds per named phase, and every subprocess started."""

    def __init__(self):
        self.seconds: dict = {}
        self.procs: list = []

    def wrap(self, owner, name: str, label: str):
        fn = getattr(owner, name)
        phases = self

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                phases.seconds[label] = phases.seconds.get(label, 0.0) + time.perf_counter() - t

        timed.__wrapped__ = fn
        setattr(owner, name, timed)

    def watch_subprocesses(self):
        real = subprocess.Popen
        phases = self

        class Popen(real):
            def __init__(self, cmd, *a, **k):
                self._t = time.perf_counter()
                self._cmd = cmd
                super().__init__(cmd, *a, **k)

            def wait(self, *a, **k):
                rc = super().wait(*a, **k)
                self._done()
                return rc

            def communicate(self, *a, **k):
                out = super().communicate(*a, **k)
                self._done()
                return out

            def _done(self):
                if getattr(self, "_recorded", False):
                    return
                self._recorded = True
                cmd = self._cmd if isinstance(self._cmd, (list, tuple)) else [self._cmd]
                phases.procs.append((os.path.basename(str(cmd[0])), time.perf_counter() - self._t, list(map(str, cmd))))

        subprocess.Popen = Popen


def cmd_imports(args) -> int:
    """What a spawned worker pays before its first kernel: the interpreter and the imports."""
    _fresh_caches()
    out = {}
    t = time.perf_counter()
    import torch  # noqa: F401
    out["import torch"] = time.perf_counter() - t
    t = time.perf_counter()
    import tilelang  # noqa: F401
    out["import tilelang"] = time.perf_counter() - t
    t = time.perf_counter()
    import flashsink  # noqa: F401
    from flashsink.ops.compiler import compile as keys  # noqa: F401
    out["import flashsink"] = time.perf_counter() - t
    t = time.perf_counter()
    keys.versions()
    out["versions() (nvcc --version)"] = time.perf_counter() - t
    for k, v in out.items():
        print(f"{k:32s} {v:6.2f} s")
    return 0


def _sass_hash(cubin: bytes) -> tuple[str, str]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        try:
            sass = subprocess.run(["cuobjdump", "-sass", f.name], capture_output=True, text=True, timeout=300).stdout
        except OSError:
            return "n/a", "n/a"
    # the listing names the temporary file: drop lines that mention it
    body = "\n".join(ln for ln in sass.splitlines() if f.name not in ln)
    return hashlib.sha256(body.encode()).hexdigest(), body


def code_sha256(cubin: bytes) -> str:
    """sha256 over the cubin's ELF sections other than the line-info / debug ones (.debug_*, .nv_debug_*
    and their relocations): nvcc's ``-lineinfo`` (always on in TileLang) records the path of the
    temporary .cu file, so two builds of the same source differ there and only there. Covers the SASS
    (.text.*), its constants, shared-memory sizes and the kernel attributes (.nv.info*)."""
    import struct

    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    heads = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    stroff = heads[shstrndx][4]

    def name(h):
        end = cubin.index(b"\0", stroff + h[0])
        return cubin[stroff + h[0]:end].decode()

    digest = hashlib.sha256()
    for h in heads:
        n = name(h)
        if "debug" in n or n in (".strtab", ".shstrtab", ".symtab"):
            continue
        digest.update(n.encode() + struct.pack("<IQQ", h[1], h[2], h[5]))
        if h[1] != 8:  # SHT_NOBITS (.nv.shared.*): its size only
            digest.update(cubin[h[4]:h[4] + h[5]])
    return digest.hexdigest()


def cmd_one(args) -> int:
    _fresh_caches()
    phases = Phases()
    phases.watch_subprocesses()
    t_imp = time.perf_counter()
    import tilelang  # noqa: F401
    import importlib
    lower_mod = importlib.import_module("tilelang.engine.lower")
    from tilelang.jit.adapter import tvm_ffi as ffi_adapter  # noqa: F401
    from tilelang.contrib import nvcc as nvcc_mod
    from tilelang.cuda import backend as cuda_backend

    from flashsink.ops.compiler import compile as c
    from flashsink.ops.compiler import diskcache, compile as keys, compile as lowering
    imports = time.perf_counter() - t_imp

    cubins = []
    real_compile_cuda = nvcc_mod.compile_cuda

    def compile_cuda(code, *a, **k):
        data = real_compile_cuda(code, *a, **k)
        cubins.append((code, bytes(data)))
        return data

    nvcc_mod.compile_cuda = compile_cuda
    phases.wrap(nvcc_mod, "compile_cuda", "nvcc (compile_cuda)")
    phases.wrap(keys, "build_prim_func", "PrimFunc (kernel's Python)")
    phases.wrap(keys, "cache_key", "cache key (TIR script + sha256)")
    phases.wrap(diskcache, "load", "disk cache lookup")
    phases.wrap(diskcache, "store", "disk cache store (export .so, fsync)")
    phases.wrap(lowering, "jit", "JITKernel total")
    phases.wrap(lower_mod, "lower_to_host_device_ir", "  lowering passes")
    phases.wrap(lower_mod, "device_codegen", "  device codegen + nvcc")
    phases.wrap(lower_mod, "device_codegen_without_compile", "  device codegen (source only)")
    phases.wrap(lower_mod, "host_codegen", "  host codegen")
    cfg = _cfg(args.problem, args.arch)
    if args.profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
    t = time.perf_counter()
    c.compile_kernel(args.kind, cfg)
    total = time.perf_counter() - t
    if args.profile:
        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").dump_stats(args.profile)
    res = {"kind": args.kind, "config": cfg.short(), "imports_s": round(imports, 2), "compile_kernel_s": round(total, 2),
           "phases_s": {k: round(v, 2) for k, v in phases.seconds.items()},
           "subprocesses": [(name, round(s, 2), " ".join(cmd) if args.verbose else "") for name, s, cmd in phases.procs]}
    if args.keep and cubins:
        os.makedirs(args.keep, exist_ok=True)
        code, cubin = cubins[-1]
        with open(os.path.join(args.keep, f"{args.kind}.cu"), "w") as f:
            f.write(code)
        with open(os.path.join(args.keep, f"{args.kind}.cubin"), "wb") as f:
            f.write(cubin)
        nv = [cmd for name, _, cmd in phases.procs if name == "nvcc"]
        if nv:
            with open(os.path.join(args.keep, f"{args.kind}.nvcc.json"), "w") as f:
                json.dump(nv[-1], f)
    if args.hash and cubins:
        code, cubin = cubins[-1]
        sass_sha, _ = _sass_hash(cubin)
        res["source_sha256"] = hashlib.sha256(code.encode()).hexdigest()
        res["cubin_sha256"] = hashlib.sha256(cubin).hexdigest()
        res["cubin_code_sha256"] = code_sha256(cubin)
        res["sass_sha256"] = sass_sha
    print(json.dumps(res, indent=1))
    return 0


def cmd_first_use(args) -> int:
    _fresh_caches()
    t_imp = time.perf_counter()
    from flashsink.ops.compiler import compile as c
    from flashsink.ops.compiler import kinds, registry
    imports = time.perf_counter() - t_imp
    if args.jobs:
        registry.FIRST_USE_JOBS = args.jobs
    cfg = _cfg(args.problem, args.arch)
    wanted = kinds.first_use_kinds("fwd", cfg)
    t = time.perf_counter()
    registry._build_config("fwd", cfg)
    secs = time.perf_counter() - t
    print(json.dumps({"config": cfg.short(), "kinds": wanted, "imports_s": round(imports, 2),
                      "first_use_s": round(secs, 2), "built": sorted(k for k, _ in registry._cache),
                      "counts": dict(c.counts)}, indent=1))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    one = sub.add_parser("one")
    one.add_argument("kind")
    one.add_argument("--keep", help="directory for the CUDA source, cubin and nvcc command")
    one.add_argument("--hash", action="store_true", help="sha256 of the cubin and its SASS")
    one.add_argument("--profile", help="cProfile output file")
    one.add_argument("--verbose", action="store_true", help="print subprocess command lines")
    fu = sub.add_parser("first-use")
    fu.add_argument("--jobs", type=int)
    sub.add_parser("imports")
    for p in (one, fu):
        p.add_argument("--problem", default="golden", choices=sorted(PROBLEMS))
        p.add_argument("--arch", default="sm_90a")
    args = ap.parse_args()
    return {"one": cmd_one, "first-use": cmd_first_use, "imports": cmd_imports}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
