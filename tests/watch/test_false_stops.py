"""No false stops: correct programs that use NaN and Inf on purpose, or hit a framework's
routine overflow, run through the CLI with --batch as through plain python — exit 0, no
stop, the same output and the same final weights (each prints a digest of its weights)
— on the watch's host path and on its device path (MLDEBUG_SIMULATE_DEVICE=1).

The programs are tests/programs_false_stops/*.py; each one's docstring says what it does
on purpose. Every program runs once per path (plain python, the CLI, the CLI on the
device path), two at a time, and the tests read those runs."""
from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import TESTS, clean_env

PROGRAMS = TESTS / "programs_false_stops"
# (program, its arguments): what each one does on purpose is in its docstring
CASES = [
    ("generate.py", ()),             # transformers' sampling (top_k, top_p, repetition
                                     # penalty: -inf logits) and beam search
    ("beam_search.py", ()),          # beam scores initialised to -inf
    ("padded_attention.py", ()),     # finfo(dtype).min masks, a fully padded sample
    ("nanogpt.py", ()),              # masked_fill(-inf) causal attention, top-k sampling
    ("missing_values.py", ()),       # NaN markers cleaned by nan_to_num / where / nanmean
    ("distance_search.py", ()),      # inf as the initial minimum of a distance search
    ("class_metric.py", ()),         # a metric's nanmean over a class that never occurs
    ("grad_scaler.py", ("32",)),     # GradScaler from 2^32 on float16
    ("grad_scaler.py", ("48",)),     # ... and from 2^48
    ("bf16_autocast.py", ()),        # bfloat16 autocast
    ("isfinite_checks.py", ()),      # torch.isinf / isnan / isfinite checks of its own
    ("action_masking.py", ()),       # illegal actions masked with -inf logits
    ("transformer_mask.py", ()),     # a -inf causal mask passed into the model call
    ("max_pool_padding.py", ()),     # -inf padding (full, F.pad) under a max
    ("normalized_embeddings.py", ()),  # F.normalize / norm of an all-zero row: torch's
                                       # backward formula masks its own 0/0
    ("foreach_optimizer.py", ()),    # Adam(foreach=True), gradients zeroed in place and
                                     # clipped by foreach kernels
    ("per_sample_grads.py", ()),     # torch.func: vmap(grad(...)) over functional_call,
                                     # jacrev, a gradient penalty
    ("t5_relative_buckets.py", ()),  # T5's log(0) cast to an integer bucket, generate
    ("ctc_zero_infinity.py", ()),    # CTCLoss(zero_infinity=True), an infeasible sample
    ("jit_trace.py", ()),            # torch.jit.script, torch.jit.trace, training the trace
    ("grad_scaler_clip.py", ()),     # GradScaler with unscale_ and clip_grad_norm_:
                                     # the clip makes NaN of an overflow (inf * 0)
    ("grad_scaler_layernorm.py", ()),  # GradScaler from 2^40: NaN from the overflow's
                                       # Infs in LayerNorm's and attention's backward
    ("generate_banned_words.py", ()),  # generate with bad_words_ids, a -inf sequence_bias
    ("backward_formulas.py", ()),    # logcumsumexp's, xlogy's and cumprod's backward make
                                     # an Inf/NaN they discard themselves
    ("ctc_speech.py", ()),           # Wav2Vec2-Conformer with CTC: _ctc_loss's
                                     # workspace (log_alpha) is no value, on a device too
    ("half_precision_masks.py", ()),  # Funnel's and LongT5's float32 masks below what
                                      # float16 holds, cast to it: -inf
    ("summed_masks.py", ()),         # two finfo.min masks summed to -inf: GPT-Neo's
                                     # attention, a causal plus a padding mask
    ("moe_router_gap.py", ()),       # PhiMoE's router in bfloat16: 0/0 under no_grad,
                                     # only compared with a threshold
]
IDS = [f"{name[:-3]}{'-' + '-'.join(args) if args else ''}" for name, args in CASES]
RUNS = {"plain": [sys.executable],
        "cli": [sys.executable, "-m", "mldebug", "--batch"],
        "cli-device": [sys.executable, "-m", "mldebug", "--batch"]}


def _run(case, how):
    name, args = case
    env = clean_env(MLDEBUG_SIMULATE_DEVICE="1") if how == "cli-device" else clean_env()
    if how != "cli-device":
        env.pop("MLDEBUG_SIMULATE_DEVICE", None)
    return subprocess.run([*RUNS[how], str(PROGRAMS / name), *args], capture_output=True,
                          text=True, env=env, cwd=str(PROGRAMS), timeout=600)


@pytest.fixture(scope="module")
def runs():
    """Every (program, path) run once, two at a time (the machine's cores): futures."""
    pool = ThreadPoolExecutor(max_workers=2)
    futures = {(case, how): pool.submit(_run, case, how) for case in CASES for how in RUNS}
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


def test_there_are_a_dozen_programs_at_least():
    assert len({name for name, _ in CASES}) >= 12
    assert sorted(p.name for p in PROGRAMS.glob("*.py")) == sorted({n for n, _ in CASES})


@pytest.mark.parametrize("how", ["cli", "cli-device"], ids=["host-path", "device-path"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_a_correct_program_runs_through_without_a_stop_and_computes_the_same_bits(
        runs, case, how):
    plain = runs[(case, "plain")].result()
    assert plain.returncode == 0, plain.stderr
    assert "weights " in plain.stdout
    watched = runs[(case, how)].result()
    assert "mldebug: stop" not in watched.stdout + watched.stderr, watched.stderr
    assert watched.returncode == 0, watched.stderr
    assert watched.stdout == plain.stdout          # its output and its weights, bitwise
