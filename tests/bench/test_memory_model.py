"""bench/memory_model.py writes figures the planner reads (a quick run on the CPU, seconds)."""

from bench import memory_model
from services.scheduler import gpu_memory


def test_the_bench_writes_a_calibration_the_planner_loads(tmp_path):
    out = tmp_path / "memory_calibration.json"
    memory_model.main(["--quick", "--out", str(out)])
    table = gpu_memory.load(out)
    assert set(table) == {"cpu-fp32", "cuda-bf16"}
    cpu = table["cpu-fp32"]
    assert cpu.state_per_param == {"weights": 4.0, "grads": 4.0, "moments": 8.0}  # fp32 AdamW, measured
    # what backward keeps shrinks with each policy; full keeps about the block's fp32 input (4 B x d)
    kept = [
        gpu_memory.layer_bytes(cpu, memory_model.fit_shape(2, **memory_model.FIT_SHAPES[1]), p)
        for p in gpu_memory.POLICIES
    ]
    assert kept[0] > kept[1] > kept[2] > 0 and abs(kept[2] / 128 - 4.0) < 0.5
    assert table["cuda-bf16"].compiled_ratio == round(95_528 / 160_040, 4)
    assert "proxy until a GPU measurement" in table["cuda-bf16"].basis
