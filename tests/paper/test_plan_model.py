"""The planner's step-time model and calibration as arithmetic: the fit recovers known rates, the
engine's calibrated costs land where they are counted (per micro-batch, per step), measured
collective rates replace the ring model, a verified step is whole optimizer steps, disk
offload's buffers are resident on a CPU only where a sub-group uses them, and a GPU's peak is the
larger of backward's start and the step, with pinned buffers at their allocator's sizes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from zeroshard.app.plan_calibrate import block_terms, fit, least_squares
from zeroshard.app.plan_verify import line, memory_terms, optimizer_step_s, out_of_order, \
    Reference, reference_config, steps_in_order
from zeroshard.paper import plan_memory
from zeroshard.paper.plan_memory import Setup, activations, disk_sub_groups, peak, pinned_rounding, states
from zeroshard.paper.plan_shapes import gpt2_shape
from zeroshard.paper.plan_time import Rates, collective_time, compute_time, step_time, token_time

RATES = Rates(matmul=1e11, memory=1e10, host_adam=1e9, host_link=0.0, collective=1e9, mp_collective=1e9,
              disk_read=1e9, disk_write=1e9, overlap=False, layer_fixed=1e-3, elementwise=2e8,
              weights=5e8, device_adam=1e8)
SHAPE = gpt2_shape("medium", 6, 256, 4, 256, 64)


def test_the_fit_recovers_known_rates_and_drops_a_negative_term():
    truth = [2e-3, 1 / 4e11, 1 / 2e8, 1 / 5e8]
    rows = [block_terms(w, t, 64) for w, t in [(64, 64), (64, 1024), (256, 256), (512, 64), (512, 1024),
                                               (1024, 256)]]
    seconds = [sum(c * x for c, x in zip(truth, r)) for r in rows]
    assert fit(rows, seconds) == pytest.approx(truth, rel=1e-6)
    # a term the times do not need (here: none of the per-parameter work) comes out 0, not negative
    seconds = [s - truth[3] * r[3] for s, r in zip(seconds, rows)]
    found = fit(rows, [s * (1 - 1e-3 * (r[3] > 1e6)) for s, r in zip(seconds, rows)])
    assert min(found) >= 0 and found[0] == pytest.approx(truth[0], rel=0.05)


def test_the_fit_holds_when_the_matmuls_measured_slow_explain_more_than_a_whole_block():
    """The calibration fits the block's other terms beside its matmuls at the measured matrix rate.
    Measured a tenth slow, the matmuls alone exceed the two largest shapes' times: the rest is fitted
    in the relative error of each block's whole time, so every shape stays within 15% and the
    dispatch and elementwise terms keep their place (fitted to what the matmuls left, in its own
    relative error, a remainder near 0 outweighed every other shape, and the fit gave 0 for all
    three: the smallest shape predicted at a third of its time)."""
    truth = [2e-3, 1 / 2e10, 1 / 2e8, 1 / 5e8]  # the matmuls nine tenths of the largest blocks
    shapes = [(64, 64), (64, 1024), (256, 256), (512, 64), (512, 1024), (1024, 256)]
    rows = [block_terms(w, t, 64) for w, t in shapes]
    seconds = [sum(c * x for c, x in zip(truth, r)) for r in rows]
    matmuls = [1.1 * truth[1] * r[1] for r in rows]  # the matrix rate measured a tenth slow
    assert max(m / s for m, s in zip(matmuls, seconds)) > 1  # (so a remainder is below 0)
    rest = [[r[0], r[2], r[3]] for r in rows]
    found = fit(rest, seconds, matmuls)
    assert found[0] > 0 and found[1] > 0, found  # the dispatch and elementwise terms kept
    for r, s, m in zip(rest, seconds, matmuls):
        assert m + sum(c * x for c, x in zip(found, r)) == pytest.approx(s, rel=0.15)


def test_engine_costs_count_per_micro_batch_and_per_step():
    rates = replace(RATES, engine_fixed=0.01, engine_per_param=1e-8)
    one, four = (Setup(2, "bf16", micro_batch=2, accumulation=a, seq=64) for a in (1, 4))
    per_micro = compute_time(SHAPE, one, rates)
    assert per_micro == pytest.approx(compute_time(SHAPE, one, RATES) + 0.01)
    a, b = step_time(SHAPE, one, 2, rates), step_time(SHAPE, four, 2, rates)
    assert b.compute - a.compute == pytest.approx(3 * per_micro)  # Ψ's share once per step, not 4x
    assert a.compute == pytest.approx(per_micro + 1e-8 * SHAPE.psi)


def test_the_token_scale_grows_the_token_work_alone():
    """engine_token_scale multiplies what grows with a micro-batch's tokens (matrix and elementwise
    work), not the per-parameter work, the layers' dispatch or the engine's fixed part: doubling
    the tokens doubles only the scaled part."""
    scaled = replace(RATES, engine_token_scale=0.5, engine_fixed=0.01)
    small, large = (Setup(1, "bf16", micro_batch=m, seq=64) for m in (2, 4))
    for s in (small, large):
        extra = compute_time(SHAPE, s, scaled) - compute_time(SHAPE, s, RATES)
        assert extra == pytest.approx(0.5 * token_time(SHAPE, s, RATES) + 0.01)
    assert token_time(SHAPE, large, RATES) == pytest.approx(2 * token_time(SHAPE, small, RATES))


def test_checkpointing_grows_the_blocks_work_by_the_measured_recompute_and_not_the_heads():
    """A checkpointed block costs 1 + the calibrated recompute share of a plain one (a third where
    not calibrated), in its token work and its dispatch; the head (the output projection and the
    loss's softmax over the vocabulary) is not checkpointed and costs the same."""
    plain, ckpt = (Setup(1, "bf16", checkpointing=c, micro_batch=4, seq=64) for c in (False, True))
    tokens = 4 * 64
    vocab, width = SHAPE.vocab, SHAPE.width
    head = 6 * tokens * vocab * width / RATES.matmul + 2 * tokens * vocab / RATES.elementwise
    blocks = token_time(SHAPE, plain, RATES) - head
    for share, rates in ((1 / 3, RATES), (0.2, replace(RATES, recompute=0.2))):
        assert token_time(SHAPE, ckpt, rates) == pytest.approx(head + (1 + share) * blocks)
        weights = SHAPE.psi / RATES.weights
        dispatch = compute_time(SHAPE, ckpt, rates) - token_time(SHAPE, ckpt, rates) - weights
        assert dispatch == pytest.approx((SHAPE.layers * (1 + share) + 1) * RATES.layer_fixed)
    assert token_time(SHAPE, plain, replace(RATES, recompute=0.2)) == token_time(SHAPE, plain, RATES)


def test_the_calibration_measures_what_a_recompute_adds_to_a_block():
    """block_rates times the block checkpointed beside plain: a recompute runs the forward again, so
    it adds more than nothing and less than a whole forward and backward; Rates carry the share.
    Each shape's measured and fitted time is kept, the fit's terms at the fitted rates, so that a
    miss elsewhere can be refitted from the cache."""
    import torch

    from zeroshard.app.plan_calibrate import CPU_SHAPES, SEQ, block_rates, block_terms
    from zeroshard.app.plan_hw import rates_of

    figures = block_rates(torch.float32, "cpu", lambda: None)
    assert 0.05 < figures["recompute"] < 1.0, figures
    assert [b[:2] for b in figures["blocks"]] == [list(s) for s in CPU_SHAPES]
    for width, tokens, measured, fitted in figures["blocks"]:
        once, flops, elements, params = block_terms(width, tokens, SEQ["cpu"])
        rated = [(elements, figures["elementwise"]), (params, figures["weights"])]
        expected = once * figures["layer_fixed"] + flops / figures["matmul"]
        expected += sum(n / r for n, r in rated if r)
        assert fitted == pytest.approx(expected) and measured > 0
    misses = [abs(f / m - 1) for _, _, m, f in figures["blocks"]]
    assert figures["fit_worst"] == pytest.approx(max(misses))
    full = {**figures, "memory": 1e10, "host_adam": 1e9, "disk_read": 1e9, "disk_write": 1e9}
    assert rates_of(full, cuda=False).recompute == figures["recompute"]


def test_on_a_cpu_stages_1_2_reuse_two_buffers_unless_something_is_allocated_between():
    """On a CPU group gloo's reduce-scatter receives a full-size buffer (stages 1-3), and stage 2
    also holds units' full-size gradients until their reduce-scatters: two of each in flight, glibc
    reusing a freed one for the next unit's, unless each unit's backward allocates first
    (checkpointing's recompute, stage 3's gather): then every unit's stays a hole until the step."""
    full = [p for p, _ in plan_memory.shards(SHAPE, 1, 2)]
    gb = 2  # bf16 gradients
    for checkpointing, held in ((False, 2 * max(full)), (True, sum(full))):
        zero, one, two = (peak(SHAPE, Setup(st, "bf16", checkpointing=checkpointing, micro_batch=2, seq=64),
                               2, "cpu") for st in (0, 1, 2))
        assert one.parts["transient"] - zero.parts["transient"] == pytest.approx(gb * held)  # received
        assert two.parts["transient"] - one.parts["transient"] == pytest.approx(gb * held)  # gradients
    stage0, stage3 = (peak(SHAPE, Setup(st, "bf16", micro_batch=2, seq=64), 2, "cpu").parts["transient"]
                      for st in (0, 3))
    gathered = 2 * (full[0] + 2 * max(full[1:]))  # bf16 units: the root and two others
    assert stage3 - gathered - stage0 == pytest.approx(2 * gb * sum(full))  # received and gradients
    assert 2 * max(full) < sum(full)  # (the two counts differ for this model)


def test_the_reference_fit_solves_three_terms_and_drops_negative_ones():
    """engine_reference's fit of the step residuals (fixed + per parameter + token scale): exact
    where the residuals follow the terms; a term whose coefficient comes out negative (noise) is
    0 and the others are fitted again."""
    rows = [[1.0, 1e5, 0.01], [1.0, 5e6, 0.03], [1.0, 2.5e7, 0.09], [1.0, 5e6, 0.4]]
    truth = [0.005, 4e-9, 1.5]
    ys = [sum(c * x for c, x in zip(truth, r)) for r in rows]
    assert least_squares(rows, ys) == pytest.approx(truth, rel=1e-6)
    falling = [0.02, 0.019, 0.018, 0.02]  # falls with Ψ: no per-parameter term
    found = least_squares(rows, falling)
    assert found[1] == 0.0 and min(found) >= 0
    assert least_squares(rows, [-0.01, -0.02, -0.01, -0.03]) == [0.0, 0.0, 0.0]  # all below 0: none


def test_a_reference_run_timed_out_of_order_is_found():
    """engine_reference measures again the reference whose step contradicts the others' order (a
    busy machine for the length of one run): the medium run slower than the large one here."""
    predicted = [0.01, 0.05, 0.25, 0.20]  # tiny, medium, large (16 tokens), medium (4 x 64)
    assert out_of_order(predicted, [0.012, 0.06, 0.27, 0.22]) is None
    assert out_of_order(predicted, [0.012, 0.06, 0.22, 0.23]) is None  # (within the slack)
    assert out_of_order(predicted, [0.012, 0.565, 0.23, 0.22]) == 1
    assert out_of_order(predicted, [0.3, 0.06, 0.27, 0.22]) == 0

    def point(predicted_s, measured_s):
        return Reference(0.0, 0.0, 0, measured_s - predicted_s, 0.0, 0.0, 0.0, predicted_s)
    references = [("tiny", 16, 1), ("medium", 16, 1), ("large", 16, 1), ("medium", 64, 4)]
    busy = [point(p, m) for p, m in zip(predicted, [0.012, 0.565, 0.23, 0.22])]
    again = []
    quiet = lambda size, seq, batch: again.append(size) or point(0.05, 0.06)  # noqa: E731
    assert steps_in_order(busy, references, quiet) and again == ["medium"]
    assert busy[1].step_residual == 0.06 - 0.05
    still_busy = [point(p, m) for p, m in zip(predicted, [0.012, 0.565, 0.23, 0.22])]
    with pytest.warns(UserWarning, match="out of order.*--recalibrate"):
        assert not steps_in_order(still_busy, references, lambda *r: point(0.05, 0.565))


def test_measured_collective_rates_replace_the_ring_model():
    assert collective_time("all_reduce", 1e9, 2, RATES) == pytest.approx(1.0)  # 2 x (1/2) x 1e9 / 1e9
    assert collective_time("all_gather", 1e9, 4, RATES) == pytest.approx(0.75)
    measured = replace(RATES, all_gather=5e8)
    assert collective_time("all_gather", 1e9, 4, measured) == pytest.approx(2.0)
    slow = replace(RATES, latency=1e-3)
    s = Setup(3, "bf16", micro_batch=1, accumulation=2, seq=64)
    extra = step_time(SHAPE, s, 2, slow).total - step_time(SHAPE, s, 2, RATES).total
    assert extra == pytest.approx(1e-3 * len(SHAPE.units) * (2 + 4))  # 2 reduce-scatters, 4 gathers


def test_a_verified_step_is_whole_optimizer_steps_without_the_first():
    assert optimizer_step_s([9.0, 1.0, 2.0, 1.0, 3.0, 1.0], 2) == pytest.approx(3.5)  # (3, 4) -> 3.5
    assert optimizer_step_s([9.0, 2.0, 4.0], 1) == pytest.approx(3.0)
    assert optimizer_step_s([5.0], 1) == 5.0


def test_the_reference_line_fits_three_points_and_never_goes_negative():
    """engine_reference's least-squares line: exact through collinear points; a negative slope (noise
    in the references) is 0, with the mean as the intercept; an intercept below 0 is 0."""
    assert line([1.0, 2.0, 4.0], [3.0, 5.0, 9.0]) == pytest.approx((1.0, 2.0))
    assert line([1.0, 2.0, 3.0], [0.3, 0.2, 0.1]) == pytest.approx((0.2, 0.0))
    assert line([1.0, 2.0, 3.0], [1.0, 3.0, 5.0]) == pytest.approx((0.0, 2.0))


def test_the_runtimes_share_of_activations_comes_from_the_two_medium_references():
    """engine_reference's memory terms: the fixed part and the share per byte from the two smaller
    runs, the share per activation byte from what the medium run of 4 x 64 tokens grew beyond their
    line (the medium run of 16 differs from it in its tokens alone), per byte of its activations
    beyond 16 tokens'; exact where the residuals follow the terms. None below 0, and none on a GPU."""
    fixed, per_byte, per_activation_byte = 2e7, 0.05, 0.4
    excess = [0.0, 0.0, 0.0, 3e7]  # (the three runs of one 16-token sequence have none)
    predicted = [3e6, 1.1e8, 5.6e8, 1.3e8]
    grown = [p + fixed + per_byte * p + per_activation_byte * e for p, e in zip(predicted, excess)]
    found = memory_terms(predicted, grown, excess, gpu=False)
    assert found == pytest.approx((fixed, per_byte, per_activation_byte))
    fewer = grown[:3] + [predicted[3] + fixed + per_byte * predicted[3] - 1e6]  # grew less: no share
    assert memory_terms(predicted, fewer, excess, gpu=False) == pytest.approx((fixed, per_byte, 0.0))
    assert memory_terms(predicted, grown, excess, gpu=True)[2] == 0.0


def test_a_micro_batchs_activations_join_the_runtimes_bytes_on_the_host():
    """weigh's runtime: the share per activation byte applies to the micro-batch's activations
    beyond one 16-token sequence's, so it grows with the model's depth (and width and vocabulary) at
    the same tokens, where a share per token would not; at 16 tokens it is the references' line;
    checkpointing leaves it as it is."""
    from zeroshard.paper.plan import Hardware, activation_excess, weigh

    hw = Hardware(nodes=1, per_node=2, device_bytes=8e9, host_bytes=64e9, disk_bytes=0.0, rates=RATES,
                  device="cpu", runtime_bytes=1e7)
    s = Setup(1, "fp32", micro_batch=4, seq=64)
    plain, more = weigh(SHAPE, s, hw), weigh(SHAPE, s, replace(hw, runtime_per_activation_byte=0.5))
    excess = sum(activations(SHAPE, s)) - sum(activations(SHAPE, replace(s, micro_batch=1, seq=16)))
    assert activation_excess(SHAPE, s) == pytest.approx(excess) and excess > 0
    assert more.peak.host - plain.peak.host == pytest.approx(0.5 * excess)
    assert more.peak.parts["runtime"] == pytest.approx(1e7 + 0.5 * excess)
    deeper = replace(SHAPE, layers=2 * SHAPE.layers)
    assert activation_excess(deeper, s) > 1.8 * excess
    assert activation_excess(SHAPE, replace(s, micro_batch=1, seq=16)) == 0.0
    # a recompute allocates the block's tensors again: checkpointing keeps fewer, not fewer made
    assert activation_excess(SHAPE, replace(s, checkpointing=True)) == pytest.approx(excess)


@pytest.mark.parametrize("family", [
    {"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, "n_inner": 3072, "vocab_size": 50257,
     "n_positions": 1024},
    {"model_type": "llama", "num_hidden_layers": 22, "hidden_size": 2048, "num_attention_heads": 32,
     "num_key_value_heads": 4, "intermediate_size": 5632, "head_dim": 64, "vocab_size": 32000,
     "max_position_embeddings": 2048, "rms_norm_eps": 1e-5},
    {"model_type": "qwen2", "num_hidden_layers": 3, "hidden_size": 128, "num_attention_heads": 4,
     "num_key_value_heads": 2, "intermediate_size": 352, "vocab_size": 1000, "max_position_embeddings": 512,
     "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]},
])
def test_a_reference_in_the_models_family_has_a_built_in_sizes_shape(family):
    """reference_config: the family's architecture (its other keys kept) at a built-in size's layers,
    width and heads, its MLP and key/value heads in the family's proportions, over bytes."""
    from zeroshard.app.sizes import SIZES
    from zeroshard.paper.plan_shapes import shape_from_hf

    for size, (layers, width, heads) in SIZES.items():
        config = reference_config(family, size)
        shape = shape_from_hf(config, size)
        assert (shape.layers, shape.width, shape.heads, shape.vocab) == (layers, width, heads, 256)
        assert {k: v for k, v in config.items() if k in ("model_type", "rms_norm_eps")} == \
            {k: v for k, v in family.items() if k in ("model_type", "rms_norm_eps")}
        inner = config.get("n_inner") or config["intermediate_size"]
        scaled = (family.get("n_inner") or family["intermediate_size"]) * width / family.get(
            "n_embd", family.get("hidden_size"))
        assert inner % 8 == 0 and abs(inner - scaled) <= 4
        if "num_key_value_heads" in family:
            kv = config["num_key_value_heads"]
            per_kv = family["num_attention_heads"] // family["num_key_value_heads"]
            assert heads % kv == 0 and heads // kv <= per_kv and "head_dim" not in config
        if "layer_types" in family:  # one per layer, the family's pattern repeated from its start
            assert config["layer_types"] == [family["layer_types"][i % 3] for i in range(layers)]


def test_disk_buffers_are_resident_on_a_cpu_only_where_sub_groups_use_them(monkeypatch):
    s = Setup(2, "fp32", "nvme", micro_batch=1, seq=64)
    count, largest = disk_sub_groups(SHAPE, s, 2)
    assert count == 1 and largest > 0
    cpu = peak(SHAPE, s, 2, "cpu")
    gpu = peak(SHAPE, s, 2, "cuda")  # pinned on a GPU machine: every buffer is resident
    assert gpu.host >= plan_memory.NVME_BUFFER_COUNT * largest
    assert states(SHAPE, s, 2).transfer >= plan_memory.NVME_BUFFER_COUNT * largest  # allocated: all
    # were every buffer used (as many sub-groups as buffers), all would be resident
    monkeypatch.setattr(plan_memory, "disk_sub_groups", lambda *a: (plan_memory.NVME_BUFFER_COUNT, largest))
    every = peak(SHAPE, s, 2, "cpu")
    assert every.host - cpu.host == pytest.approx((plan_memory.NVME_BUFFER_COUNT - 1) * largest)


def test_across_nodes_mics_and_hpz_are_weighed_and_written_as_configs_that_load():
    import zeroshard
    from zeroshard.app.plan_report import config_of
    from zeroshard.paper.plan import Hardware, plan

    slow_link = replace(RATES, collective=1e8, mp_collective=1e10)
    hw = Hardware(nodes=2, per_node=2, device_bytes=8e9, host_bytes=64e9, disk_bytes=0.0, rates=slow_link,
                  nvme=False)
    plans = {p.setup.name: p for p in plan(SHAPE, hw, 8, 64, "bf16", [1])}
    mics, hpz, plain = (plans[f"stage 3, bf16{extra}, mb 2 x 1"] for extra in (", MiCS 2", ", hpZ 2", ""))
    # MiCS shards over its group of 2: a rank's states are those of stage 3 on 2 ranks
    assert states(SHAPE, mics.setup, 4) == states(SHAPE, Setup(3, "bf16", micro_batch=2, seq=64), 2)
    assert hpz.peak.parts["secondary"] > 0 and hpz.peak.device > plain.peak.device
    assert mics.time.comm < hpz.time.comm < plain.time.comm  # less over the slow link, in that order
    for p in (mics, hpz):
        config = zeroshard.Config.load(config_of(p, 8, None))
        on = (config.zero.mics_shard_size > 0, config.zero.zero_hpz_partition_size > 1)
        assert on == ((True, False) if p is mics else (False, True))


def test_a_written_config_pins_both_offloads_as_the_cli_does():
    """--write (and so --verify) pins both offloads, as `zeroshard train --offload-*` does; the
    engine then pins the master only where it goes up itself (tests/parity/test_offload.py), as
    pinned_rounding counts it."""
    from types import SimpleNamespace

    import zeroshard
    from zeroshard.app.plan_report import config_of
    from zeroshard.app.train import TrainArgs

    setup = Setup(3, "bf16", "cpu", "cpu", micro_batch=1, seq=16)
    zero = zeroshard.Config.load(config_of(SimpleNamespace(setup=setup), 2, None)).zero
    assert zero.offload_pin_memory and zero.offload_param_pin_memory
    raw = TrainArgs(offload_optimizer="cpu", offload_param="cpu").engine_config()["zero_optimization"]
    assert raw["offload_optimizer"]["pin_memory"] and raw["offload_param"]["pin_memory"]


def test_a_gpus_measured_fixed_bytes_join_every_device_peak():
    """Hardware.device_runtime_bytes (engine_reference's device residual on a GPU: the math
    libraries' workspaces) adds to each configuration's device peak, and is named in its parts."""
    from zeroshard.paper.plan import Hardware, weigh

    hw = Hardware(nodes=1, per_node=1, device_bytes=8e9, host_bytes=64e9, disk_bytes=0.0, rates=RATES)
    s = Setup(3, "bf16", micro_batch=1, seq=64)
    plain, more = weigh(SHAPE, s, hw), weigh(SHAPE, s, replace(hw, device_runtime_bytes=5e7))
    assert more.peak.device - plain.peak.device == pytest.approx(5e7) and more.peak.host == plain.peak.host
    assert more.peak.parts["device_runtime"] == 5e7 and "device_runtime" not in plain.peak.parts


def test_a_gpu_peak_holds_no_gradient_at_backwards_start_at_stage_3():
    """On a GPU (its allocator reuses what it frees) the peak is the larger of two moments:
    backward's start (every activation; at stages 2-3 with one micro-batch no gradient yet) and
    the step (the gradients, the activations gone). Accumulating, the reduced shards stay."""
    one = Setup(3, "bf16", micro_batch=8, seq=256)
    st, (kept, _) = states(SHAPE, one, 1, one_memory=False), activations(SHAPE, one)
    p = peak(SHAPE, one, 1, "cuda")
    tensors = p.device - p.parts["fragmentation"]
    assert tensors == pytest.approx(st.device - st.grads + kept + p.parts["transient"])
    assert kept > st.grads  # (so the moment without gradients is the larger here)
    two = replace(one, accumulation=2)
    held = peak(SHAPE, two, 1, "cuda")
    assert held.device - held.parts["fragmentation"] >= states(SHAPE, two, 1, one_memory=False).device + kept
    # a CPU's heap keeps what backward frees: there everything adds, gradients included
    cpu = peak(SHAPE, one, 1, "cpu")
    assert cpu.host >= states(SHAPE, one, 1).device + kept + cpu.parts["transient"]


def test_the_steps_fp32_gradient_copy_is_counted_only_where_one_is_made():
    """The step's fp32 gradient of a sub-group (flat_grad.set_step_grad) is a copy only where the
    reduced gradient is 16-bit: in fp32, and at stages 2-3 with accumulation (an fp32 shard), the
    optimizer steps on it as it is. Beside it, the optimizer's temporaries (4 bytes an owned element)
    always, on a GPU and on a CPU group alike."""
    def step(setup, nproc, device):
        return peak(SHAPE, setup, nproc, device).parts["step"]

    owned = sum(shard for _, shard in plan_memory.shards(SHAPE, 1, 2))
    plain = Setup(2, "bf16", micro_batch=2, seq=64)
    assert step(plain, 2, "cuda") == 8 * owned  # the copy and the temporaries
    assert step(replace(plain, accumulation=2), 2, "cuda") == 4 * owned  # an fp32 shard: no copy
    assert step(replace(plain, precision="fp32"), 2, "cuda") == 4 * owned
    assert step(plain, 2, "cpu") == 8 * owned
    assert step(replace(plain, accumulation=2), 2, "cpu") == 4 * owned
    whole = sum(padded for padded, _ in plan_memory.shards(SHAPE, 1, 2))
    assert step(replace(plain, stage=0), 2, "cpu") == 8 * whole  # stage 0 owns the whole buffer
    assert step(replace(plain, stage=0, precision="fp32"), 2, "cpu") == 4 * whole


def test_pinned_host_buffers_count_at_the_next_power_of_two():
    """torch's pinned-memory allocator rounds each block up to a power of two: a flat buffer of
    1000 and one of 3000 bf16 elements, each with a gradient and a staging buffer (2000 -> 2048,
    6000 -> 8192 bytes) waste 2 x (48 + 2192) bytes. With parameter offload no staging, but the
    shard at rest is pinned (the same sizes); in fp32 the master goes up itself, pinned, beside the
    gradient buffer (4000 -> 4096, 12000 -> 16384); nvme adds its streaming buffers. Nothing pinned
    without offload or on a CPU."""
    shape = replace(SHAPE, units=(1000, 3000))
    offload = Setup(3, "bf16", "cpu", micro_batch=1, seq=16)
    assert pinned_rounding(shape, offload, 1) == 2 * (48 + 2192)
    assert pinned_rounding(shape, replace(offload, offload_param="cpu"), 1) == 2 * (48 + 2192)
    assert pinned_rounding(shape, replace(offload, offload_optimizer="none", offload_param="cpu"), 1) == \
        48 + 2192
    assert pinned_rounding(shape, replace(offload, precision="fp32"), 1) == 2 * (96 + 4384)
    assert pinned_rounding(shape, replace(offload, offload_optimizer="none"), 1) == 0
    # nvme: the same gradient and staging buffers, and 4 streaming buffers of the one sub-group's
    # files (3 x (4032 + 12032) bytes, 64-aligned: 48192 -> 65536)
    assert pinned_rounding(shape, replace(offload, offload_optimizer="nvme"), 1) == \
        2 * (48 + 2192) + 4 * (65536 - 48192)
    gpu, cpu = peak(shape, offload, 1, "cuda"), peak(shape, offload, 1, "cpu")
    assert gpu.parts["pinned_rounding"] == 2 * (48 + 2192) and cpu.parts["pinned_rounding"] == 0


def _saved_bytes(model, tokens, loss_of) -> int:
    """Bytes autograd saves for backward in one forward (each storage once, parameters left out)."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_of(model, tokens)
    return sum(seen.values())


GPT2_HF = {"model_type": "gpt2", "n_embd": 128, "n_head": 4, "vocab_size": 512, "n_positions": 64}
LLAMA_HF = {"model_type": "llama", "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
            "intermediate_size": 344, "vocab_size": 512, "max_position_embeddings": 64,
            "tie_word_embeddings": False}


def _model_and_shape(family: str, extra: dict, layers: int, folder):
    import json

    from zeroshard.app.gpt import GPT, GPTConfig

    if family == "builtin":
        model = GPT(GPTConfig(seq_len=64, layers=layers, width=128, heads=4))
        return model, gpt2_shape("b", layers, 128, 4, 256, 64)
    from zeroshard.hf import causal_lm_from_config
    from zeroshard.paper.plan_shapes import shape_from_hf

    key = "n_layer" if family == "gpt2" else "num_hidden_layers"
    config = {**(GPT2_HF if family == "gpt2" else LLAMA_HF), **extra, key: layers}
    path = folder / f"{family}-{layers}.json"
    path.write_text(json.dumps(config))
    return causal_lm_from_config(str(path), 64), shape_from_hf(config)


@pytest.mark.parametrize("family, extra", [("builtin", {}), ("gpt2", {}), ("llama", {}),
                                           ("llama", {"model_type": "mixtral", "num_local_experts": 4,
                                                      "num_experts_per_tok": 2}),
                                           ("llama", {"model_type": "gpt_neox"}),
                                           ("llama", {"model_type": "phi", "num_key_value_heads": 4,
                                                      "resid_pdrop": 0.0, "embd_pdrop": 0.0}),
                                           ("llama", {"model_type": "opt", "ffn_dim": 344, "dropout": 0.0,
                                                      "word_embed_proj_dim": 128}),
                                           ("gpt2", {"activation_function": "gelu", "resid_pdrop": 0.0,
                                                     "embd_pdrop": 0.0, "attn_pdrop": 0.0})])
def test_a_blocks_predicted_activations_match_what_autograd_saves(tmp_path, family, extra):
    """What one block keeps for backward, as the planner counts it, against the bytes autograd
    actually saves (bf16, training mode): the difference between a 4- and a 2-block model, for the
    built-in GPT and two Hugging Face families with their own activation functions, fp32 norms and
    dropout, a mixture of experts (its tokens routed, and the router's probabilities), and two
    plain-MLP families read off the built model (GPT-NeoX: GELU and LayerNorm; Phi: GPT-2's
    "gelu_new"; OPT: ReLU). Within 10%."""
    import torch

    from zeroshard.app.gpt import lm_loss
    from zeroshard.app.train import logits_of
    from zeroshard.paper.plan_memory import activations

    if family != "builtin":
        pytest.importorskip("transformers")
    torch.manual_seed(0)
    tokens, setup = torch.randint(0, 256, (4, 64)), Setup(1, "bf16", micro_batch=4, seq=64)
    measured, predicted = [], []
    for layers in (2, 4):
        model, shape = _model_and_shape(family, extra, layers, tmp_path)
        model = model.to(torch.bfloat16).train()
        measured.append(_saved_bytes(model, tokens, lambda m, x: lm_loss(logits_of(m(x)), x)))
        predicted.append(activations(shape, setup)[0])
    ratio = (predicted[1] - predicted[0]) / (measured[1] - measured[0])
    assert 0.9 <= ratio <= 1.1, (family, extra, predicted, measured)
    # and the whole model's: the blocks, the embeddings, and the loss's fp32 log-softmax alone (the
    # logits and their fp32 copy are freed once the loss is computed; counting them was 2.5 times
    # the head's bytes)
    assert 0.9 <= predicted[1] / measured[1] <= 1.1, (family, extra, predicted, measured)


def test_cached_rates_older_than_max_age_are_measured_again(tmp_path, monkeypatch):
    """calibrate(): cached figures are returned with their age; figures older than `max_age` (what
    --verify passes) are measured again; `again` always measures."""
    import os

    from zeroshard.app import plan_calibrate, plan_hw

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    runs = []
    monkeypatch.setattr(plan_calibrate, "measure", lambda *a: runs.append(a) or {"matmul": float(len(runs))})
    figures, age = plan_hw.calibrate("bf16", 2, str(tmp_path), False)
    assert figures == {"matmul": 1.0} and age is None and len(runs) == 1
    figures, age = plan_hw.calibrate("bf16", 2, str(tmp_path), False, max_age=3600)
    assert figures == {"matmul": 1.0} and 0 <= age < 60 and len(runs) == 1
    path = plan_hw.calibration_path("bf16", 2)
    os.utime(path, (os.path.getatime(path), os.path.getmtime(path) - 7200))
    figures, age = plan_hw.calibrate("bf16", 2, str(tmp_path), False)
    assert figures == {"matmul": 1.0} and age > 7000  # no limit: the cache serves
    figures, age = plan_hw.calibrate("bf16", 2, str(tmp_path), False, max_age=3600)
    assert figures == {"matmul": 2.0} and age is None and len(runs) == 2
    figures, age = plan_hw.calibrate("bf16", 2, str(tmp_path), False, again=True)
    assert figures == {"matmul": 3.0} and len(runs) == 3


def test_a_cpu_plan_for_bf16_experts_says_their_kernels_grow_the_process():
    """oneDNN keeps a bf16 kernel per matmul shape, and a mixture of experts' batches change shape
    every step: no peak in the table counts that, so a CPU plan in bf16 says so (fp32, a dense
    model or a GPU: nothing to say)."""
    from types import SimpleNamespace

    from zeroshard.app.plan_report import cpu_notes
    from zeroshard.paper.plan_shapes import shape_from_hf

    llama = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
             "num_key_value_heads": 2, "intermediate_size": 176, "vocab_size": 256,
             "max_position_embeddings": 128}
    mixtral = {**llama, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}
    moe, dense = shape_from_hf(mixtral, "moe"), shape_from_hf(llama, "dense")
    cpu, gpu = SimpleNamespace(device="cpu"), SimpleNamespace(device="cuda")
    assert "ONEDNN_PRIMITIVE_CACHE_CAPACITY" in " ".join(cpu_notes(moe, cpu, "bf16"))
    assert cpu_notes(moe, cpu, "fp32") == cpu_notes(dense, cpu, "bf16") == cpu_notes(moe, gpu, "bf16") == []
    assert "DTensor" in " ".join(cpu_notes(dense, cpu, "fp32", mp=2))
    assert cpu_notes(dense, gpu, "bf16", 2) == []


def test_where_nothing_fits_nvme_is_suggested_with_the_disk_it_needs():
    """smallest_change on a machine without --nvme-path (no disk weighed): nvme offload is still
    tried, on a disk of any size, and suggested with the space it needs; on a CPU group more nodes
    are machines like this one (no --nodes flag, which would plan another machine's GPUs)."""
    from zeroshard.paper.plan import Hardware, plan, smallest_change

    hw = Hardware(nodes=1, per_node=2, device_bytes=64e9, host_bytes=64e9, disk_bytes=0.0, rates=RATES,
                  device="cpu", nvme=False)
    roomy = replace(hw, nvme=True, disk_bytes=1e15)
    big = gpt2_shape("1.2B", 24, 2048, 16, 50257, 128)
    plans = [p for p in plan(big, roomy, 2, 128, "bf16", [1]) if p.fits]
    on_disk = min(p.peak.host for p in plans if "nvme" in p.setup.name)
    in_memory = min(p.peak.host for p in plans if "nvme" not in p.setup.name)
    assert on_disk < in_memory
    between = (on_disk + in_memory) / 2 * hw.per_node  # (a node's host memory, its ranks' peaks)
    tight = replace(hw, device_bytes=between, host_bytes=between)
    assert not any(p.fits for p in plan(big, tight, 2, 128, "bf16", [1]))
    changes = smallest_change(big, tight, 2, 128, "bf16", [1], machine_flags=None)
    assert changes[0].startswith("nvme offload (give --nvme-path, a directory on a fast local disk with ")
    assert any(c.startswith("more machines like this one: 2 (4 ranks)") for c in changes), changes


def test_mics_and_hpz_are_weighed_only_with_several_gpus_a_node():
    """Within a node of one GPU there is nothing to shard over: MiCS 1 would be a full copy per rank
    (DDP), listed once as if it were a choice."""
    from zeroshard.paper.plan import Hardware, plan

    for per_node, expected in ((1, False), (2, True)):
        hw = Hardware(nodes=2, per_node=per_node, device_bytes=80e9, host_bytes=1e12, disk_bytes=0.0,
                      rates=RATES)
        names = [p.setup.name for p in plan(SHAPE, hw, 8, 64, "bf16", [1])]
        assert any("MiCS" in n or "hpZ" in n for n in names) is expected, names


def test_uncalibrated_ties_go_to_fewer_micro_batches_then_less_communication():
    """For another machine (rates from its figures: no layer's dispatch cost, communication hidden
    under compute) every micro-batch size takes the same time; the recommendation is then one
    micro-batch a step, at the stage with the least communication, not stage 3 at micro-batch 1
    (the least memory), which launches and gathers once per micro-batch."""
    import argparse

    from zeroshard.app.plan_hw import given_hardware
    from zeroshard.paper.plan import plan

    hw, _ = given_hardware(argparse.Namespace(nodes=1, gpus_per_node=8, gpu_mem=80.0, host_mem=1000.0))
    ranked = [p for p in plan(SHAPE, hw, 64, 64, "bf16", [1]) if p.fits]
    best = ranked[0]
    tied = [p for p in ranked if abs(p.time.total / best.time.total - 1) < 0.005]
    assert {p.setup.accumulation for p in tied} > {1}, "no tie to break"
    assert best.setup.accumulation == 1 and best.setup.stage < 3, best.setup.name
    assert best.time.comm == min(p.time.comm for p in tied if p.setup.accumulation == 1)


def test_a_calibration_whose_block_fit_missed_a_shape_says_step_times_are_less_certain(tmp_path, monkeypatch):
    """The hardware line of a plan on this machine notes a block fit that missed one of its shapes
    by more than the step-time target (25%), and stays quiet for a fit within it."""
    import argparse

    from zeroshard.app import plan, plan_calibrate

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    figures = {"matmul": 1e11, "memory": 1e10, "host_adam": 1e9, "disk_read": 1e9, "disk_write": 1e9}
    args = argparse.Namespace(nproc=2, verify=False, verify_top=None, precision="bf16", nvme_path=None,
                              recalibrate=True)
    for worst, noted in ((0.4, True), (0.1, False)):
        monkeypatch.setattr(plan_calibrate, "measure", lambda *a, w=worst: {**figures, "fit_worst": w})
        _, line = plan._hardware(None, args, local=True)
        assert ("missed one of its shapes by 40%" in line) is noted, line
