"""Every tiny backbone with the same weights on CPU (PyTorch chunk form) and CUDA (Triton kernels).

Measured on an H100 (benchmarks/results/NOTES.md, 'Seed-mixer backbones, CPU vs CUDA'): logits
relative error 3.6e-5 .. 8.6e-5, worst parameter-gradient relative error 1.1e-3 .. 5.4e-3 (TF32
products in the kernels); the bounds below leave a factor of about 4 to 10.
"""
import pytest
import timm
import torch

import hdla_vision  # noqa: F401  registers the models
from tests.oracle import rel_err, worst

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TINY = sorted(name for name in timm.list_models(module=["hdla", "seed"]) if name.endswith("_tiny"))


@pytest.mark.parametrize("name", TINY)
def test_backbone_cpu_and_cuda_agree(name):
    torch.manual_seed(0)
    cpu = timm.create_model(name, img_size=64, depth=2, num_classes=10)
    gpu = timm.create_model(name, img_size=64, depth=2, num_classes=10).cuda()
    gpu.load_state_dict(cpu.state_dict())
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    out_cpu, out_gpu = cpu(x), gpu(x.cuda())
    out_cpu.square().mean().backward()
    out_gpu.square().mean().backward()
    assert rel_err(out_gpu.cpu(), out_cpu) < 1e-3
    grad_errors = {n: rel_err(pg.grad.cpu(), pc.grad) for (n, pc), pg in zip(cpu.named_parameters(), gpu.parameters())}
    assert worst(grad_errors) < 2e-2, sorted(grad_errors.items(), key=lambda item: -item[1])[:3]
