"""``train.py --compile`` traces a NaLaDiT training step as one graph: no graph break, also
on the steps that record the query-exponent statistics (``GatedLinearAttention.observe``
keeps them as a tensor; ``last_stats`` reads them as floats outside the compiled region).
dynamo's trace only (``backend="eager"``): graph breaks are dynamo's, the inductor build
would add tens of seconds and nothing to count."""
import torch
from torch._dynamo.utils import counters

from nala_dit.models.dit import create_model


def test_compiled_training_step_has_no_graph_break():
    torch.manual_seed(0)
    model = create_model("NaLaDiT-T/2", input_size=8, in_channels=1, num_classes=10, depth=1)
    eager = model.blocks[0].attn
    eager.record_stats = True
    x, t, y = torch.randn(2, 1, 8, 8), torch.tensor([10, 900]), torch.tensor([1, 2])
    model(x, t, y)
    want = eager.last_stats
    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(model, backend="eager")
    step(x, t, y).float().square().mean().backward()
    assert dict(counters["graph_break"]) == {}, "graph breaks in a compiled training step"
    assert counters["stats"]["unique_graphs"] == 1
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    got = eager.last_stats                                       # recorded inside the compiled forward
    assert set(got) == {"exponent_mean", "exponent_std", "saturated"}
    assert all(abs(got[k] - want[k]) <= 1e-6 * max(1.0, abs(want[k])) for k in want), (got, want)
