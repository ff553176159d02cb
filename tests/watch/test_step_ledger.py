"""The ledger on its own (mldebug/watch/step_ledger.py): what one read finds, which judges
it runs, what it holds, and what it must never do (crash on memory let go since)."""
from __future__ import annotations

import collections

import torch

from mldebug.watch import step_ledger
from mldebug.watch.step_ledger import StepLedger, first_bad

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from opcount import count_step  # noqa: E402


def test_a_finite_read_runs_only_the_judges_that_always_run():
    ledger = StepLedger()
    ran = []
    ledger.hold([torch.ones(3), torch.zeros(2, 2)])
    ledger.then(lambda values: ran.append(("bad", values)))
    ledger.then(lambda values: ran.append(("always", values)), always=True)
    values, judges, _ = ledger.take()
    assert values is None
    for judge, always in judges:
        if values is not None or always:
            judge(values)
    assert ran == [("always", None)]
    assert not ledger and not ledger.holds_tensors()


def test_a_bad_read_gives_each_slot_its_value():
    ledger = StepLedger()
    a, b, c = torch.ones(3), torch.tensor([1.0, float("inf")]), torch.tensor([float("nan")])
    slots = ledger.hold([a, b]) + ledger.hold([c], alive=True)
    values, _, held = ledger.take()
    assert first_bad(values, slots[:1]) is None
    assert first_bad(values, slots[1:2]) == float("inf")
    assert first_bad(values, slots[2:]) != first_bad(values, slots[2:])      # NaN
    assert any(x is b for x, _ in held)        # alive while the judges run


def test_one_read_is_a_few_ops_whatever_the_number_of_tensors():
    """One `_foreach_norm` a dtype, one stack, one amax, one read: 4 ops for 50 tensors."""
    xs = [torch.randn(4, 4) for _ in range(50)]

    def read():
        ledger = StepLedger()
        ledger.hold(xs[:30])
        ledger.hold(xs[30:], alive=True)
        ledger.take()

    ops, reads = count_step(read)
    assert ops == collections.Counter({"aten::_foreach_norm": 1, "aten::stack": 1,
                                       "aten::amax": 1, "aten::item": 1}), ops
    assert reads == 1


def test_temporaries_are_held_within_the_bound_and_alive_tensors_once():
    ledger = StepLedger()
    big = torch.zeros(step_ledger._GROUP_BYTES // 4)
    ledger.hold([big])                           # at the bound: reduced and let go at once
    assert not ledger._held and len(ledger._norms) == 1
    p = torch.ones(3)
    assert ledger.hold([p], alive=True) == ledger.hold([p], alive=True)
    assert len(ledger._kept) == 1


def test_a_temporary_reduced_before_a_write_and_an_empty_one_live_until_the_read():
    """A judge reads an op's inputs at the read (what a stop's hint needs: a divisor's
    zeros, an empty input's shape): a temporary reduced early, because an op is about to
    write its memory, and an empty one (nothing to reduce) stay alive until then, within
    the temporaries' bound, and are let go by the read."""
    import weakref
    ledger = StepLedger()
    divisor, empty = torch.zeros(4, 1), torch.zeros(0, 4)
    slots = ledger.hold([divisor, empty])
    ledger.reduce_before_write({divisor.untyped_storage().data_ptr()})
    assert not ledger._held and len(ledger._norms) == 1         # reduced: the value is kept
    divisor.fill_(float("nan"))                                 # (the write comes after)
    gone = weakref.ref(divisor), weakref.ref(empty)
    del divisor, empty
    assert all(ref() is not None for ref in gone)               # alive for the judges
    ledger.then(lambda values: None)
    values, _, held = ledger.take()
    assert values is None and first_bad(values, slots) is None  # the value before the write
    del held
    assert all(ref() is None for ref in gone)                   # let go by the read
    big = torch.zeros(step_ledger._GROUP_BYTES // 8 + 1)
    ledger.hold([big])
    ledger.reduce_before_write({big.untyped_storage().data_ptr()})
    assert ledger._aside_bytes > step_ledger._GROUP_BYTES // 8
    ledger.hold([torch.zeros(step_ledger._GROUP_BYTES // 8)])   # the bound, together
    assert not ledger._aside and not ledger._held


def test_memory_let_go_since_is_not_read_and_the_rest_still_is():
    """FSDP frees gathered parameters with `resize_(0)`: reading one would read freed
    memory (a segfault); it is left out, and a NaN beside it is still found."""
    ledger = StepLedger()
    freed, bad = torch.ones(1000), torch.tensor([float("nan")])
    slots = ledger.hold([freed, bad])
    freed.untyped_storage().resize_(0)
    values, _, _ = ledger.take()
    assert first_bad(values, slots[:1]) is None and first_bad(values, slots[1:]) is not None


def test_a_slice_whose_storage_was_shrunk_below_its_reach_is_not_read(monkeypatch):
    """A slice with gaps (`base[::10]`: 10 values over 91 elements of memory) is in its
    storage by the extent of its strides, not by its element count: a storage shrunk part
    of the way (`resize_` to 50 elements) would otherwise be read past its end."""
    from mldebug.core.native import values_address, with_values
    base = torch.ones(100)
    sliced, dense = base[::10], torch.ones(4)
    assert values_address(sliced) and len(with_values([(sliced,), (dense,)])) == 2
    base.untyped_storage().resize_(50 * 4)
    assert values_address(sliced) == 0
    assert [item[0] is dense for item in with_values([(sliced,), (dense,)])] == [True]
    # channels-last is dense too: asked all at once with the contiguous ones (C loops,
    # no per-tensor test), and kept
    channels_last = torch.ones(2, 3, 4, 4).to(memory_format=torch.channels_last)
    import mldebug.core.native as native
    asked, real = [], native._in_storage
    monkeypatch.setattr(native, "_in_storage", lambda x: asked.append(x) or real(x))
    assert len(with_values([(channels_last,), (dense,)])) == 2 and not asked
    assert values_address(channels_last) and asked == [channels_last]


def test_an_optimizers_tensors_whose_memory_was_let_go_are_not_read(monkeypatch):
    """An optimizer's parameters and state are grouped once (update.StepTensors) with
    the memory each reaches (`memory_needed`); a later step compares it in C loops: one
    let go since (FSDP's `resize_(0)`) is left out, a NaN beside it is still found, and
    a group that could not be measured (an empty tensor) is asked in full."""
    from mldebug.core.native import memory_needed
    p, freed, bad = torch.ones(8), torch.ones(1000)[10:], torch.tensor([1.0, float("nan")])
    xs = [p, freed, bad]
    assert memory_needed(xs)[1] == [32, 4000, 8]
    assert memory_needed([torch.ones(100)[::10], torch.ones(1).expand(5)])[1] == [364, 4]
    assert memory_needed([p, torch.ones(0)]) is None
    ledger = StepLedger()
    slots = ledger.hold_grouped({"key": (xs, [0, 1, 2], memory_needed(xs))}, 3)
    freed.untyped_storage().resize_(0)
    values, _, _ = ledger.take()
    assert [first_bad(values, [s]) is None for s in slots] == [True, True, False]
    # a parameter given other memory (`p.data = ...`), the old measure no longer its own
    moved, big = torch.ones(10), torch.ones(2000)
    found = memory_needed([moved])
    moved.data = big[1000:1010]
    big.untyped_storage().resize_(80)
    reduced = []
    norm = torch._foreach_norm
    monkeypatch.setattr(torch, "_foreach_norm", lambda xs, *a, **k: (
        reduced.extend(xs), norm(xs, *a, **k))[1])
    ledger.hold_grouped({"key": ([moved, p], [0, 1], found and (found[0] + [p.data_ptr()],
                                                                 found[1] + [32]))}, 2)
    ledger.take()
    assert [id(x) for x in reduced] == [id(p)]  # (moved: its memory is not there)
    empty = torch.ones(0)
    slots = ledger.hold_grouped({"key": ([p, empty, bad], [0, 1, 2], None)}, 3)
    values, _, _ = ledger.take()
    assert [first_bad(values, [s]) is None for s in slots] == [True, True, False]


def test_a_judge_that_comes_after_the_read_of_its_tensors_still_gets_their_values():
    ledger = StepLedger()
    slots = ledger.hold([torch.tensor([float("inf")])])
    values, _, _ = ledger.take()                 # read while its window was still open
    assert first_bad(values, slots) == float("inf")
    ledger.hold([torch.ones(2)])
    values, _, _ = ledger.take()                 # the next read still has it
    assert first_bad(values, slots) == float("inf")
    values, _, _ = ledger.take()                 # and then no more
    assert values is None


def test_a_subclass_is_checked_by_its_local_values_or_not_at_all():
    class Wrapped(torch.Tensor):
        pass

    ledger = StepLedger()
    w = torch.tensor([float("nan")]).as_subclass(Wrapped)
    slots = ledger.hold([w])
    assert ledger._held == []                    # nothing a norm could read: not held
    values, _, _ = ledger.take()
    assert first_bad(values, slots) is None


def test_under_cuda_graph_capture_nothing_is_read_and_it_is_said_once(monkeypatch):
    """A read (a sync) would break a capture, and a captured graph's tensors have no values
    until it is replayed: the watch holds nothing of it and reads nothing, with one
    warning (the capture itself needs a GPU: here the CPU takes the device path and the
    capture is pretended)."""
    import warnings
    import torch.nn as nn
    from mldebug.watch import core, watch
    from mldebug.core import cuda_graphs
    monkeypatch.setattr(cuda_graphs, "capturing", lambda: True)
    monkeypatch.setattr(cuda_graphs, "MAYBE", [1])     # (no capture_begin counted it)
    monkeypatch.setattr(cuda_graphs, "_SAID", set())
    took = []
    monkeypatch.setattr(StepLedger, "take", lambda self: took.append(1))
    core.simulate_device(True)
    try:
        got = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with watch(on_violation=got.append):
                for _ in range(2):
                    nn.Linear(4, 4)(torch.full((2, 4), float("nan")))
    finally:
        core.simulate_device(False)
    assert took == [] and got == []
    assert sum("CUDA graph" in str(w.message) for w in caught) == 1


def test_tensors_with_gaps_or_overlaps_are_reduced_apart_from_the_dense_ones(monkeypatch):
    """On a GPU `_foreach_norm` fuses its list into one launch only when every tensor in
    it is dense; one slice or expanded gradient among a step's few hundred tensors would
    make it reduce each of them with a launch of its own. So the ledger puts those few in
    a list of their own, and still finds a NaN in either kind."""
    lists = []
    norm = torch._foreach_norm

    def recording(xs, *args, **kwargs):
        lists.append(list(xs))
        return norm(xs, *args, **kwargs)

    monkeypatch.setattr(torch, "_foreach_norm", recording)
    dense = [torch.randn(3, 4), torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
             torch.randn(6, 8).t(), torch.randn(5)]
    column = torch.randn(3, 1)
    gapped = [torch.randn(6, 8)[:, ::2], column.expand(3, 4)]    # (12 values, 3 in memory)
    for bad in (None, dense[0], gapped[0], gapped[1]):
        lists.clear()
        ledger = StepLedger()
        if bad is not None:
            with torch.no_grad():
                (column if bad is gapped[1] else bad)[0, 0] = float("nan")
        slots = ledger.hold(dense[:2] + gapped[:1]) + ledger.hold(dense[2:] + gapped[1:],
                                                                  alive=True)
        values, _, _ = ledger.take()
        assert sorted(len(xs) for xs in lists) == [2, 4], lists
        assert sorted(map(id, lists[0] + lists[1])) == sorted(map(id, dense + gapped))
        assert {id(x) for x in dense} in ({id(x) for x in xs} for xs in lists)
        if bad is None:
            assert values is None
        else:
            i = [id(x) for x in dense[:2] + gapped[:1] + dense[2:] + gapped[1:]].index(
                id(bad))
            assert first_bad(values, slots[i:i + 1]) is not None
            assert first_bad(values, slots[:i] + slots[i + 1:]) is None
            with torch.no_grad():
                (column if bad is gapped[1] else bad)[0, 0] = 0.0
