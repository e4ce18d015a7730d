"""Mutation check: plant known bugs one at a time and see whether the test suite catches each.

    python benchmarks/mutations.py                 # every planted bug (about 10 min on 2 idle cores)
    python benchmarks/mutations.py --only fp16-unscale persistent-regather
    python benchmarks/mutations.py --list

Each mutation replaces one exact piece of the core's code (it must occur exactly once: a bug whose
target code has moved stops the run loudly instead of passing), in a temporary copy of src/, tests/
and benchmarks/, and runs the tests that should catch it there. Tolerance checks report their error
as a multiple of the tolerance (tests/margins.py); a planted bug counts as caught when a test fails
on an exact check or an error, or on a tolerance check with an error at least CATCH_MARGIN times the
tolerance. A narrower failure is reported as NARROW and counts as a survivor, like a pass.
A benchmark, not part of CI: run it before resolving a change to the core or to the tests.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CATCH_MARGIN = 5.0
MARKER = "x the tolerance"  # in every failure message of tests/margins.close


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str          # relative to the repository root
    find: str          # exact text, exactly once in the file
    replace: str
    tests: tuple[str, ...]
    why: str = ""      # the bug in words


P, T, R = "tests/parity/test_parity.py", "tests/parity/test_training.py", "tests/precision/test_precision.py"
C, MEM, ROB = ("tests/checkpoint/test_checkpoint.py", "tests/accounting/test_memory.py",
               "tests/parity/test_robustness.py")
PARITY2 = f"{P}::test_every_stage_matches_single_process[2]"
BUCKETS = f"{P}::test_sgd_auto_units_buckets_and_persistence"
POISONED = f"{P}::test_unfilled_gradient_memory_is_never_read_before_it_is_written"
TRAINING = f"{T}::test_training_semantics_match_single_process[3]"
RESUME = f"{C}::test_resume_at_another_world_size_and_stage"
BIT_EXACT = f"{C}::test_resume_is_bit_exact_at_the_same_world_size_and_stage"
RESUME_16 = f"{C}::test_16bit_and_offload_checkpoints_resume_at_another_world_size"
BF16 = f"{R}::test_bf16_every_stage"
SGD_16 = f"{R}::test_16bit_training_with_sgd_against_fp32"
SCALER = f"{R}::test_loss_scale_schedule"
ONE_RANK_COUNTS = "tests/accounting/test_traffic.py::test_one_rank_counts_the_collectives_it_does_not_send"
NF = "tests/faults/test_nonfinite.py"
NONFINITE = f"{NF}::test_nonfinite_gradient_is_raised_or_skipped_on_every_rank"
OFF = "tests/parity/test_offload.py"
OFF_PARITY = f"{OFF}::test_offload_matches_training_in_place[2]"
OFF_DELAYED = f"{OFF}::test_delayed_param_update_follows_its_definition[3]"

MUTATIONS = [
    Mutation("rs-bucket-no-mean", "src/zeroshard/comm/buckets.py",
             "_mean_part(rows[:, a:b].to(dtype, copy=True).contiguous().view(-1), n)",
             "rows[:, a:b].to(dtype, copy=True).contiguous().view(-1)", (BUCKETS,),
             "bucketed reduce-scatter sums instead of averaging over ranks"),
    Mutation("rs-single-no-mean", "src/zeroshard/comm/buckets.py", "        _mean_part(full, n)\n", "",
             (BUCKETS,), "one-bucket reduce-scatter sums instead of averaging"),
    Mutation("all-reduce-no-mean", "src/zeroshard/comm/buckets.py",
             "        _mean_part(bucket, comm.world_size)\n", "", (BUCKETS,),
             "stage-0 all-reduce sums instead of averaging"),
    Mutation("chunk-drops-last-element", "src/zeroshard/core/partition.py", "min(s + step, self.shard_numel)",
             "min(s + step, self.shard_numel - 1)", (BUCKETS,), "bucket chunks skip a shard's last element"),
    Mutation("stage2-keeps-full-grad", "src/zeroshard/core/flat_grad.py",
             "            self.grads.full = None  # in-flight", "            pass  # in-flight", (f"{MEM}",),
             "stage 2 keeps its full-size gradient buffer after reducing it"),
    Mutation("master-not-counted", "src/zeroshard/core/memory.py",
             '"master": _nbytes(flat.master) if separate else 0,', '"master": 0,', (f"{MEM}", TRAINING),
             "memory_stats() leaves out the fp32 master copy"),
    Mutation("moments-not-loaded", "src/zeroshard/checkpoint/load.py",
             'optimizer.state[flat.opt_param][key][dst].copy_(request[f"optim.{key}/{name}/{piece}"][src])',
             "pass", (RESUME,), "load_checkpoint leaves the optimizer moments at zero"),
    Mutation("compute-copy-not-refreshed", "src/zeroshard/core/flat_param.py",
             "                updated.copy_(self.master)  ", "                pass  ", (BF16,),
             "the bf16 parameters are not refreshed from the fp32 master"),
    Mutation("no-real-master", "src/zeroshard/core/flat_param.py",
             "                updated.copy_(self.master)  ",
             "                updated.copy_(self.master); self.master.copy_(updated)  ", (BF16,),
             "the fp32 master is re-copied from the rounded bf16 parameters after every step"),
    Mutation("clip-norm-local", "src/zeroshard/core/step.py", "        comm.all_reduce(squares)\n",
             "        pass\n", (TRAINING,),
             "the clipping norm is this rank's shard's norm, not the global one"),
    Mutation("clip-not-applied", "src/zeroshard/core/step.py",
             "        factor *= clip_coefficient(unscaled, inputs.max_norm).item()\n", "        pass\n",
             (TRAINING,),
             "the clipping coefficient is computed but not applied"),
    Mutation("sub-group-steps-all", "src/zeroshard/core/step.py",
             "            for f in stepped:  # fp32 gradient copies for one sub-group",
             "            for f in trainable:  # fp32 gradient copies for one sub-group",
             (f"{R}::test_sub_group_step",), "every sub-group's optimizer step updates every buffer again"),
    Mutation("fp16-unscale", "src/zeroshard/core/step.py", "    factor = 1.0 / scaler.scale\n",
             "    factor = 1.0\n", (SGD_16,), "fp16 gradients are never unscaled"),
    Mutation("persistent-regather", "src/zeroshard/core/flat_param.py",
             "        return self.policy.shard_optimizer and self.persistent\n",
             "        return self.policy.shard_optimizer and self.persistent"
             " and not self.policy.shard_params\n",
             (f"{P}::test_stage3_persistent_and_gathered_units",),
             "stage-3 persistent trainable buffers are not re-gathered after the step"),
    Mutation("unreached-grad-slot-not-zeroed", "src/zeroshard/core/flat_grad.py",
             "                full[self.slot_of[i].span].zero_()\n", "                pass\n", (POISONED,),
             "stages 2-3: a parameter no gradient reached reduces the unfilled buffer's leftovers"),
    Mutation("grad-padding-not-zeroed", "src/zeroshard/core/flat_grad.py",
             "            full[self.layout.numel:].zero_()\n", "            pass\n", (POISONED,),
             "stages 2-3: the padding of the unfilled gradient buffer is reduced as it was left"),
    Mutation("first-grad-added-to-unfilled", "src/zeroshard/core/flat_grad.py",
             "if id(param) in self.grads.unwritten and target is self.grads.full:", "if False:", (POISONED,),
             "stages 2-3: a first gradient is added to the unfilled buffer instead of copied in"),
    Mutation("one-rank-reduce-overwrites", "src/zeroshard/comm/collectives.py",
             "                output.add_(full)\n", "                output.copy_(full)\n",
             (f"{T}::test_one_rank_adds_every_micro_batch",),
             "one rank, stages 2-3: a later micro-batch's gradient replaces the sum instead of adding"),
    Mutation("one-rank-reduce-not-converted", "src/zeroshard/comm/buckets.py",
             "if n == 1 and _exact_in(full, dtype):", "if n == 1:",
             ("tests/precision/test_precision.py::test_one_rank_rounds_gradients_through_the_communication_dtype",),
             "one rank: a gradient is not rounded through a narrower communication_data_type"),
    Mutation("one-rank-chunks-counted-once", "src/zeroshard/comm/buckets.py", "dtype, calls=len(chunks))",
             "dtype)", (ONE_RANK_COUNTS,),
             "one rank: comm_stats() counts one reduce-scatter a buffer where ranks would issue one a chunk"),
    Mutation("accumulation-not-averaged", "src/zeroshard/engine/engine.py",
             "factor = self.scaler.scale / self.config.gradient_accumulation_steps",
             "factor = self.scaler.scale", (TRAINING,),
             "the loss is not divided by gradient_accumulation_steps"),
    Mutation("accumulation-overwrites", "src/zeroshard/core/flat_grad.py",
             "return self.policy.shard_grads and self.grad_state in",
             "return False and self.grad_state in", (TRAINING,),
             "stages 2-3 overwrite the gradient shard with each micro-batch instead of adding"),
    Mutation("accumulate-in-16-bit", "src/zeroshard/core/precision.py",
             "accumulate = torch.float32 if config.gradient_accumulation_steps > 1 else compute",
             "accumulate = compute", (f"{R}::test_bf16_gradient_accumulation",),
             "stages 2-3 accumulate micro-batches in bf16 rather than fp32"),
    Mutation("communication-dtype-ignored", "src/zeroshard/core/precision.py",
             "reduce_dtype=config.dtype(config.communication_data_type)", "reduce_dtype=compute", (SGD_16,),
             "communication_data_type is accepted but gradients are reduced in the compute dtype"),
    Mutation("scale-never-grows", "src/zeroshard/core/precision.py", "                self.scale *= 2.0\n",
             "                pass\n", (SCALER,),
             "the loss scale never grows after loss_scale_window clean steps"),
    Mutation("hysteresis-ignored", "src/zeroshard/core/precision.py", "        if self._tolerance > 1:",
             "        if False:", (SCALER,), "every overflow halves the scale, whatever the hysteresis"),
    Mutation("scheduler-steps-on-skip", "src/zeroshard/core/step.py",
             "    if overflow:\n        return norm\n",
             "    if overflow:\n        after_update()\n        return norm\n",
             (SCALER,), "the lr scheduler steps on skipped fp16 steps"),
    Mutation("scaler-not-loaded", "src/zeroshard/engine/state.py",
             '            self.scaler.load_state_dict(extra["scaler"])\n',
             "            pass\n", (BIT_EXACT,), "load_checkpoint does not restore the loss scale"),
    Mutation("scheduler-not-loaded", "src/zeroshard/engine/state.py",
             '                self.lr_scheduler.load_state_dict(schedule)\n', "                pass\n",
             (RESUME,), "load_checkpoint does not restore the lr scheduler"),
    Mutation("rng-not-loaded", "src/zeroshard/checkpoint/load.py",
             '        torch.set_rng_state(small[f"rng/{comm.rank}"])\n', "        pass\n", (BIT_EXACT,),
             "load_checkpoint does not restore the random generator"),
    Mutation("loaded-master-not-written-back", "src/zeroshard/engine/state.py",
             "                    flat.write_back()  # with disk offload",
             "                    pass  # with disk offload", (RESUME_16,),
             "after a load, 16-bit parameters keep their old values until the next step"),
    Mutation("buffers-not-broadcast", "src/zeroshard/engine/engine.py",
             "                comm.broadcast(b, 0)\n",
             "                pass\n", (PARITY2,),
             "initialize() keeps each rank's own buffers instead of rank 0's"),
    Mutation("replaced-param-not-refused", "src/zeroshard/core/placeholders.py", "        if replaced:\n",
             "        if False:\n",
             ("tests/api/test_gathered.py::test_a_replaced_parameter_tensor_is_refused_by_name",),
             "a parameter's tensor replaced after initialize (p.data = t) is trained apart or undone unseen"),
    Mutation("recompute-frees-unit", "src/zeroshard/core/units.py",
             "        if torch._C._current_graph_task_id() != -1:", "        if False:",
             (f"{ROB}::test_activation_checkpointing_at_every_stage",),
             "a recomputation inside backward (activation checkpointing) frees its unit like a forward"),
    Mutation("post-step-gather-not-awaited", "src/zeroshard/core/flat_param.py",
             "        if self.state is ParamState.UNSHARDING and not self.gather_behind_forward:\n"
             "            self.unshard()\n", "        pass\n", (PARITY2,),
             "the post-step all-gather (stages 1-2) is issued but the step never waits for it"),
    Mutation("stage3-keeps-units-after-forward", "src/zeroshard/core/prefetch.py",
             "        if i >= len(self.previous) or self.previous[i] is not unit:\n"
             "            return False\n",
             "        return True\n", ("tests/accounting/test_traffic.py",),
             "stage 3 keeps every unit gathered from forward to backward (memory that never shrinks)"),
    Mutation("offload-grad-version-ignored", "src/zeroshard/offload/host.py",
             "        if version == self._grad_version:\n", "        if self._grad_version >= 0:\n",
             (OFF_PARITY, OFF_DELAYED),
             "offload keeps the first gradient it copied down, missing every later step's"),
    Mutation("offload-early-copy-not-refreshed", "src/zeroshard/core/flat_grad.py",
             "        self.grads.version += 1\n", "        pass\n", (OFF_PARITY, OFF_DELAYED),
             "a gradient copied down before accumulation ended is not copied again once it changes"),
    Mutation("offload-update-not-written-back", "src/zeroshard/offload/host.py",
             "            self._written_back = self._master_read = self.copier.copy(device_shard, "
             "self.master, after)\n",
             "            self._written_back = self._master_read = None\n", (OFF_PARITY, OFF_DELAYED),
             "the updated fp32 master is never copied into the device shard"),
    Mutation("offload-param-not-copied-up", "src/zeroshard/offload/host.py",
             "            own.copy_(shard, non_blocking=True)", "            pass", (OFF_PARITY,),
             "an offloaded stage-3 shard is not copied into place before its all-gather"),
    Mutation("delayed-update-applied-at-once", "src/zeroshard/core/step.py",
             "        delayed.start_update(lambda: update(write_back=False),",
             "        update(write_back=True)\n        delayed.start_update(lambda: None,", (OFF_DELAYED,),
             "the delayed parameter update reaches the parameters in the same step (no delay)"),
    Mutation("offload-host-bytes-not-counted", "src/zeroshard/core/memory.py",
             '"transfer": flat.host.nbytes if flat.host is not None else 0,', '"transfer": 0,',
             (f"{OFF}::test_offloaded_shards_are_the_only_copy", OFF_DELAYED),
             "memory_stats() leaves out offload's host transfer buffers"),
    Mutation("device-skip-ignored", "src/zeroshard/core/step.py",
             "    optimizer.found_inf = found_inf  #", "    optimizer.found_inf = found_inf * 0  #",
             (NONFINITE,), "fused AdamW updates on a non-finite step (the device-side skip is never set)"),
    Mutation("device-clip-not-applied", "src/zeroshard/core/step.py",
             "        factor = torch.where(found_inf > 0, 1.0, clip_coefficient(norm_t, inputs.max_norm))\n",
             "        factor = torch.where(found_inf > 0, 1.0, "
             "clip_coefficient(norm_t, inputs.max_norm) * 0 + 1)\n",
             (TRAINING,),
             "the device-side clip factor is computed but not applied"),
    Mutation("device-skip-scales-gradient", "src/zeroshard/core/step.py",
             "        factor = torch.where(found_inf > 0, 1.0, clip_coefficient(norm_t, inputs.max_norm))\n",
             "        factor = clip_coefficient(norm_t, inputs.max_norm)\n",
             (f"{NF}::test_one_inf_element_or_an_overflowing_norm_is_found",),
             "a skipped step's gradient is scaled by the non-finite norm's clip factor (the report "
             "then names the wrong element)"),
    Mutation("saved-scale-into-bf16", "src/zeroshard/core/precision.py",
             '        if self.dynamic and state.get("dynamic", True):', "        if True:", (RESUME_16,),
             "an fp16 checkpoint's loss scale is loaded into a bf16 run's disabled scaler"),
    Mutation("device-decision-trusts-subclasses", "src/zeroshard/core/step.py",
             "    return (type(optimizer) in (torch.optim.Adam, torch.optim.AdamW)",
             "    return (isinstance(optimizer, torch.optim.Adam)",
             (f"{NF}::test_the_step_is_decided_on_the_device_only_where_the_optimizer_honours_it",),
             "an Adam subclass (whose step may ignore found_inf) is trusted to skip on the device"),
    Mutation("recompute-gradient-dropped", "src/zeroshard/core/reduce.py",
             "        elif reduced_now:\n            self._reduce_again()\n", "",
             (f"{ROB}::test_activation_checkpointing_at_every_stage",),
             "a gradient arriving after its buffer was reduced in the same backward (reentrant "
             "recompute of a block called twice) is dropped"),
]


def _copy_tree(dest: str) -> None:
    """What the tests read: the code, the tests, and the files some of them run as a user does (the
    README's commands, examples/), so that no test fails in the copy for want of a file."""
    for name in ("src", "tests", "benchmarks", "examples", "docs"):
        if os.path.isdir(os.path.join(ROOT, name)):
            shutil.copytree(os.path.join(ROOT, name), os.path.join(dest, name),
                            ignore=shutil.ignore_patterns("__pycache__", "out", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        if os.path.exists(os.path.join(ROOT, name)):
            shutil.copy(os.path.join(ROOT, name), dest)


def _target_text(m: Mutation, tree: str) -> str:
    """The file's text; stops the run if the target is not there exactly once (the code moved)."""
    with open(os.path.join(tree, m.path)) as f:
        text = f.read()
    found = text.count(m.find)
    if found != 1:
        raise SystemExit(f"mutation '{m.name}': its target occurs {found} times in {m.path} (must be "
                         f"exactly once); the code moved: update the mutation's `find`\n  {m.find!r}")
    return text


def planted_text(m: Mutation, tree: str) -> str:
    """The file with the bug in it. A mutation that does not compile is refused, loudly: any test
    importing the module would "catch" it, which says nothing of the tests."""
    planted = _target_text(m, tree).replace(m.find, m.replace)
    try:
        compile(planted, m.path, "exec")
    except SyntaxError as e:
        raise SystemExit(f"mutation '{m.name}' does not compile ({e}); fix its `replace`") from None
    return planted


def plant(m: Mutation, tree: str) -> None:
    text = planted_text(m, tree)
    with open(os.path.join(tree, m.path), "w") as f:
        f.write(text)


def run_tests(dest: str, tests: tuple[str, ...], timeout: float) -> dict:
    """Run `tests` in the copy; return per-test failures, margins and the outcome."""
    log, junit = os.path.join(dest, "margins.jsonl"), os.path.join(dest, "junit.xml")
    env = {**os.environ, "PYTHONPATH": os.path.join(dest, "src"), "ZEROSHARD_MARGIN_LOG": log}
    start = time.time()
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               f"--junitxml={junit}", *tests], cwd=dest, env=env, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"outcome": "hung", "seconds": time.time() - start, "ratios": {}, "closest": {},
                "failures": {}}
    ratios: dict[str, float] = {}    # test -> its largest error ratio
    closest: dict[str, str] = {}     # test -> the check that came closest to its tolerance
    if os.path.exists(log):
        for line in open(log):
            entry = json.loads(line)
            test, ratio = (entry.get("test") or "?").rsplit(" ", 1)[0], float(entry["ratio"])  # " (call)"
            if ratio >= ratios.get(test, -1.0):
                ratios[test], closest[test] = ratio, entry["what"]
    failures = {}
    if os.path.exists(junit):
        for case in ET.parse(junit).iter("testcase"):
            bad = case.find("failure") if case.find("failure") is not None else case.find("error")
            if bad is not None:
                test = f"{case.get('file') or case.get('classname')}::{case.get('name')}"
                failures[test] = (bad.get("message") or "") + "\n" + (bad.text or "")
    outcome = "passed" if done.returncode == 0 else "failed"
    if done.returncode not in (0, 1):
        failures.setdefault("pytest", done.stdout[-2000:] + done.stderr[-2000:])
        outcome = "failed"
    return {"outcome": outcome, "seconds": time.time() - start, "ratios": ratios, "closest": closest,
            "failures": failures}


def verdict(result: dict) -> tuple[str, str]:
    """(CAUGHT | NARROW | SURVIVED, how)."""
    largest = max(result["ratios"].values(), default=0.0)
    if result["outcome"] == "hung":
        return "CAUGHT", "the tests hung until the time limit (a hang is loud, but look at it)"
    if result["outcome"] == "passed":
        return "SURVIVED", f"every test passed; closest tolerance check at {largest:.3g}x"
    loud = [t for t, text in result["failures"].items() if MARKER not in text]
    if loud:
        lines = [line.strip() for line in result["failures"][loud[0]].splitlines() if line.strip()]
        errors = [line for line in lines if "Error" in line.split(":")[0] or line.startswith("E ")]
        return "CAUGHT", f"exact check or error in {loud[0]}: {(errors or lines or ['?'])[-1][:200]}"
    if largest >= CATCH_MARGIN:
        return "CAUGHT", f"tolerance check failed at {largest:.3g}x the tolerance"
    return "NARROW", f"tolerance check failed at only {largest:.3g}x the tolerance (< {CATCH_MARGIN:g}x)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="names of the mutations to run")
    parser.add_argument("--list", action="store_true", help="list the mutations and stop")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per mutation")
    parser.add_argument("--no-baseline", action="store_true", help="skip the run on the unmutated copy")
    parser.add_argument("--baseline-only", action="store_true",
                        help="only the unmutated run: how close each test's checks come to their tolerances")
    args = parser.parse_args()
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    unknown = set(args.only or []) - {m.name for m in MUTATIONS}
    if unknown:
        raise SystemExit(f"unknown mutations {sorted(unknown)}; --list shows them")
    if args.list:
        for m in chosen:
            print(f"{m.name:32s} {m.path:30s} {m.why}")
        return
    for m in chosen:  # every target found and every bug compiled before anything runs
        planted_text(m, ROOT)
    if not args.no_baseline or args.baseline_only:
        tests = tuple(dict.fromkeys(t for m in chosen for t in m.tests))
        with tempfile.TemporaryDirectory() as clean:
            _copy_tree(clean)
            base = run_tests(clean, tests, args.timeout * 2)
        if base["outcome"] != "passed":
            raise SystemExit(f"the unmutated suite fails these tests; fix that first: "
                             f"{sorted(base['failures'])}")
        print(f"baseline: {len(tests)} tests pass unmutated ({base['seconds']:.0f} s). Largest error of "
              f"each test's tolerance checks, as a multiple of its tolerance:", flush=True)
        for test, ratio in sorted(base["ratios"].items()):
            print(f"  {ratio:7.3f}x  {test}  ({base['closest'][test]})")
        if args.baseline_only:
            return
    survivors = 0
    for m in chosen:
        with tempfile.TemporaryDirectory() as dest:
            _copy_tree(dest)
            plant(m, dest)
            result = run_tests(dest, m.tests, args.timeout)
        status, how = verdict(result)
        survivors += status != "CAUGHT"
        print(f"{status:8s} {m.name:32s} {result['seconds']:5.0f} s  {how}", flush=True)
    print(f"{len(chosen) - survivors} of {len(chosen)} planted bugs caught, {survivors} survived "
          f"(a catch: an exact check, an error, or a tolerance check failing by >= {CATCH_MARGIN:g}x)")
    sys.exit(1 if survivors else 0)


if __name__ == "__main__":
    main()
