"""Building the C kernels (aserve/kernels/cbuild.py): ahead of use on threads, quietly,
and each library once, within a process and across the processes of one server."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from aserve import LLM, SamplingParams
from aserve.kernels import cbuild
from aserve.kernels.f32_linear import cpu_supported as f32_cpu_supported

TOKEN_MASK = Path(cbuild.__file__).with_name("cpu_token_mask.c")  # the quickest kernel to build
needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs a C compiler (gcc)")


@needs_gcc
def test_a_library_built_ahead_is_the_one_a_load_finds(tmp_path, monkeypatch):
    cbuild.build_ahead(TOKEN_MASK, tmp_path)
    built = list(tmp_path.glob("cpu_token_mask_*.so"))
    assert len(built) == 1 and list(tmp_path.iterdir()) == built  # no temporary file left

    def no_compiler(*args, **kwargs):
        raise AssertionError("compiled again")

    monkeypatch.setattr(cbuild.subprocess, "run", no_compiler)
    assert cbuild.build(TOKEN_MASK, tmp_path, "token masks") == built[0]
    assert cbuild.load_library(TOKEN_MASK, tmp_path, "token masks") is not None


def test_building_ahead_says_nothing_where_the_build_cannot_be_done(tmp_path, monkeypatch, caplog):
    """No compiler, a source that does not compile, a cache that cannot be written: no
    library, no log line and no exception; the load later logs why, as it always did."""
    caplog.set_level(logging.WARNING, logger="aserve.kernels")
    broken = tmp_path / "src" / "broken.c"
    broken.parent.mkdir()
    broken.write_text("int f(void) { return }\n")
    cache = tmp_path / "cache"
    if shutil.which("gcc") is not None:
        cbuild.build_ahead(broken, cache)
        assert list(cache.iterdir()) == []
    not_a_dir = tmp_path / "a-file"
    not_a_dir.write_text("")
    cbuild.build_ahead(TOKEN_MASK, not_a_dir / "kernels")  # mkdir raises OSError, even as root
    monkeypatch.setattr(cbuild.shutil, "which", lambda name: None)
    cbuild.build_ahead(TOKEN_MASK, cache)
    assert list(cache.iterdir()) == [] and caplog.records == []
    assert cbuild.load_library(TOKEN_MASK, cache, "token masks") is None
    assert "no C compiler found: token masks" in caplog.text


@needs_gcc
@pytest.mark.skipif(not f32_cpu_supported(), reason="this CPU lacks AVX2 and FMA: no float32 one-call decode step")
def test_a_first_start_compiles_each_kernel_once_the_two_slowest_side_by_side(llama_dir, tmp_path, monkeypatch):
    """A float32 model on a fresh cache: every library is compiled once (a load of a
    library a thread still builds waits on the build's lock), and the decode attention
    and the one-call decode step compile at the same time."""
    log = tmp_path / "cc.log"
    wrapper = tmp_path / "cc"
    wrapper.write_text(f'#!/bin/sh\nfor a in "$@"; do case "$a" in *.c) src=$(basename "$a");; esac; done\n'
                       f'echo "start $src" >> {log}\n{shutil.which("gcc")} "$@"\nrc=$?\n'
                       f'echo "end $src" >> {log}\nexit $rc\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("CC", str(wrapper))
    monkeypatch.setenv("ASERVE_CACHE_DIR", str(tmp_path / "cache"))
    with LLM(str(llama_dir), dtype="float32", kv_cache_memory=1 << 22, max_model_len=64) as llm:
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
    events = log.read_text().split("\n")[:-1]
    starts = [e.split()[1] for e in events if e.startswith("start")]
    assert len(starts) == len(set(starts)), events  # none compiled twice
    assert {"cpu_decode_attention.c", "cpu_llama_decode_f32.c", "cpu_f32_linear.c"} <= set(starts)
    # Both started before either ended.
    first_end = min(events.index(f"end {src}") for src in ("cpu_decode_attention.c", "cpu_llama_decode_f32.c"))
    assert max(events.index(f"start {src}") for src in ("cpu_decode_attention.c", "cpu_llama_decode_f32.c")) < first_end


@needs_gcc
def test_processes_that_want_one_library_at_once_build_it_once(tmp_path):
    """The workers of a TP server start together: one compiles each library while the
    other waits on its lock and loads what it built; no lock file stays behind."""
    log = tmp_path / "cc.log"
    asked = [tmp_path / f"asked{i}" for i in range(2)]
    wrapper = tmp_path / "cc"  # a compiler that goes on once both processes have asked for the library
    wrapper.write_text(f'#!/bin/sh\necho start >> {log}\n'
                       f'while [ ! -e {asked[0]} ] || [ ! -e {asked[1]} ]; do sleep 0.05; done\n'
                       f'exec {shutil.which("gcc")} "$@"\n')
    wrapper.chmod(0o755)
    code = ("import sys; from pathlib import Path; from aserve.kernels import cbuild; Path(sys.argv[3]).touch(); "
            "print(cbuild.build(Path(sys.argv[1]), Path(sys.argv[2]), 'token masks'))")
    env = {**os.environ, "CC": str(wrapper)}
    cache = tmp_path / "cache"
    procs = [subprocess.Popen([sys.executable, "-c", code, str(TOKEN_MASK), str(cache), str(flag)], env=env,
                              stdout=subprocess.PIPE, text=True) for flag in asked]
    outs = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outs[0] == outs[1] and outs[0].endswith(".so") and Path(outs[0]).is_file()
    assert log.read_text() == "start\n"
    assert [p.name for p in cache.iterdir()] == [Path(outs[0]).name]
