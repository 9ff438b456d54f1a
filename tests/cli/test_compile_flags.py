"""``sample.py --compile``: the model compiled in place (``nn.Module.compile``), the
source's model keeping its class. Tracing itself is held by
tests/attention/test_compiled_block.py (a NaLaDiT block with fullgraph=True, zero graph breaks)."""
from types import SimpleNamespace

import torch

import sample


def test_sample_compile_flag_compiles_the_model_in_place():
    assert sample.build_parser().parse_args(["--ckpt", "x", "--compile"]).compile is True
    assert sample.build_parser().parse_args(["--ckpt", "x"]).compile is False
    model = torch.nn.Linear(2, 2)
    source = sample.compiled(SimpleNamespace(model=model), SimpleNamespace(compile=True, cuda_graphs=False))
    assert source.model is model and model._compiled_call_impl is not None
    plain = torch.nn.Linear(2, 2)
    args = SimpleNamespace(compile=False, cuda_graphs=False)
    assert sample.compiled(SimpleNamespace(model=plain), args).model._compiled_call_impl is None
