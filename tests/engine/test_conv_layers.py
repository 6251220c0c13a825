"""Convolutions as editable layers (``service.engine.conv``) against a float64 reference that unfolds
by hand, and against ai-engram.

The reference here reads every patch value with explicit loops and index arithmetic (no
``F.unfold``, no ``F.pad``), and is itself checked to reproduce each conv's output; the statistics,
the edit ``[W | b] + c · [W | b] · Σ_f · Σ_U⁺`` and the edited conv's response are held to it.
ai-engram has no convolution handler (``engram.handlers``: ``nn.Linear`` and GPT-2 ``Conv1D`` only),
but its editor takes a handler per layer type: the one given it here flattens with the hand unfold,
so its covariances, pseudo-inverse and edit are ai-engram's own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import engram
import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from service.engine.arithmetic import apply_engrams
from service.engine.collect import LayerStatistics, PixelBatch, collect_statistics
from service.engine.compose import (
    EngramAlgebra,
    LayerDelta,
    LayerEdit,
    LayerWeights,
    layer_deltas,
    layer_edits,
    layer_scales,
)
from service.engine.conv import conv_refusal
from service.engine.editable import editable_layers, refused_layers, stored_weight, weight_matrix
from service.engine.errors import EditError
from service.engine.layers import ConvKernel, LayerSpec
from service.engine.layout import ModelLayout
from service.engine.lora import layer_lora
from service.engine.records import Batch
from tests.helpers.algebra import DELTA_TOL, WEIGHT_TOL, reference_pinv, rel

REL_TOL = 1e-5  # float32 forward + float32 GEMM per batch vs the float64 reference (as test_collect)
ORACLE_TOL = 1e-5  # measured 2e-7 to 7e-7 here (float32 means in ai-engram); test_compose allows 2e-2 on LMs
ALPHA = 0.8

# ------------------------------------------------------------------------------ the reference


def explicit_pads(conv: nn.Conv1d | nn.Conv2d) -> list[tuple[int, int]]:
    """``(before, after)`` per spatial dimension, from torch's documented rule for ``'same'``
    (total ``dilation · (k − 1)``, the odd one after)."""
    if conv.padding == "same":
        totals = [d * (k - 1) for k, d in zip(conv.kernel_size, conv.dilation, strict=True)]
        return [(t // 2, t - t // 2) for t in totals]
    if conv.padding == "valid":
        return [(0, 0) for _ in conv.kernel_size]
    return [(int(p), int(p)) for p in conv.padding]


def hand_patches(x: torch.Tensor, conv: nn.Conv1d | nn.Conv2d) -> torch.Tensor:
    """Every output position's patch, ``[B · L, C_in · Π k]`` float64, read value by value: channel,
    then kernel row, then kernel column; zero outside the input."""
    values = x.double()
    if values.ndim == 3:  # a Conv1d as a one-row Conv2d
        values = values.unsqueeze(2)
    kh, kw = (1, *conv.kernel_size) if isinstance(conv, nn.Conv1d) else conv.kernel_size
    sh, sw = (1, *conv.stride) if isinstance(conv, nn.Conv1d) else conv.stride
    dh, dw = (1, *conv.dilation) if isinstance(conv, nn.Conv1d) else conv.dilation
    pads = explicit_pads(conv)
    (ph, ph_after), (pw, pw_after) = [(0, 0), *pads] if isinstance(conv, nn.Conv1d) else pads
    batch, channels, height, width = values.shape
    out_h = (height + ph + ph_after - dh * (kh - 1) - 1) // sh + 1
    out_w = (width + pw + pw_after - dw * (kw - 1) - 1) // sw + 1
    grid = values.tolist()
    rows = []
    for b in range(batch):
        for i in range(out_h):
            for j in range(out_w):
                patch = []
                for c in range(channels):
                    for u in range(kh):
                        for v in range(kw):
                            r, q = i * sh - ph + u * dh, j * sw - pw + v * dw
                            patch.append(grid[b][c][r][q] if 0 <= r < height and 0 <= q < width else 0.0)
                rows.append(patch)
    return torch.tensor(rows, dtype=torch.float64)


def flat_weight(conv: nn.Module) -> torch.Tensor:
    """``[W | b]`` of a conv as ``[C_out, C_in · Π k (+1)]`` float64, written out here."""
    w = conv.weight.detach().double()
    w = w.reshape(w.shape[0], -1)
    if conv.bias is not None:
        w = torch.cat([w, conv.bias.detach().double()[:, None]], dim=1)
    return w


def augment(rows: torch.Tensor, bias: bool) -> torch.Tensor:
    return torch.cat([rows, torch.ones(rows.shape[0], 1, dtype=rows.dtype)], dim=1) if bias else rows


# ------------------------------------------------------------------------------ the models


class ConvNet(nn.Module):
    """Convolutions of every geometry the engine unfolds, two of them (``same``, ``twin``) reading one
    tensor alike, one (``pointwise``) reading it differently, a grouped one (refused), Conv1d over
    the flattened map, and a Linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 6, 3, stride=2, padding=1)
        self.dilated = nn.Conv2d(6, 5, (3, 2), stride=(1, 2), padding=(2, 0), dilation=(2, 1), bias=False)
        self.same = nn.Conv2d(5, 4, (2, 4), padding="same")  # pads (0, 1) rows and (1, 2) columns
        self.twin = nn.Conv2d(5, 4, (2, 4), padding="same")
        self.pointwise = nn.Conv2d(5, 4, 1, stride=2)
        self.grouped = nn.Conv2d(4, 4, 3, padding=1, groups=2)
        self.seq = nn.Conv1d(4, 3, 3, stride=2, padding=1, dilation=2)
        self.seq_same = nn.Conv1d(3, 3, 4, padding="same", bias=False)
        self.head = nn.Linear(3, 2)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.dilated(torch.tanh(self.stem(pixel_values))))
        a = self.grouped(self.same(x) + self.twin(x))
        b = self.pointwise(x)
        s = self.seq_same(torch.tanh(self.seq(a.flatten(2))))
        return self.head(s.mean(dim=2)) + b.mean()


class Sequential(nn.Module):
    """Convs one after another (ai-engram shares a product between layers reading one tensor by
    handler type alone, so its oracle model has no two convs reading the same input)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 6, 3, stride=2, padding=1)
        self.dilated = nn.Conv2d(6, 5, (3, 2), stride=(1, 2), padding=(2, 0), dilation=(2, 1), bias=False)
        self.same = nn.Conv2d(5, 4, (2, 4), padding="same")
        self.seq = nn.Conv1d(4, 3, 3, stride=2, padding=1, dilation=2)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.dilated(torch.tanh(self.stem(pixel_values))))
        return self.seq(torch.tanh(self.same(x)).flatten(2))


EDITED = ("stem", "dilated", "same", "twin", "pointwise", "seq", "seq_same", "head")
CONVS = ("stem", "dilated", "same", "twin", "pointwise", "seq", "seq_same")


def images(seed: int, count: int, shape: Sequence[int] = (3, 10, 12)) -> torch.Tensor:
    return torch.randn(count, *shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def net() -> ConvNet:
    torch.manual_seed(0)
    return ConvNet().eval()


def conv_inputs(model: nn.Module, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every conv's input in a forward over ``pixels``, as the model computes it (float32)."""
    seen: dict[str, torch.Tensor] = {}
    modules = dict(model.named_modules())
    handles = [
        modules[name].register_forward_pre_hook(lambda _m, inputs, name=name: seen.setdefault(name, inputs[0].clone()))
        for name in modules
        if isinstance(modules[name], nn.Conv1d | nn.Conv2d)
    ]
    with torch.no_grad():
        model(pixels)
    for handle in handles:
        handle.remove()
    return seen


def reference_sum(model: nn.Module, pixels: torch.Tensor, name: str) -> torch.Tensor:
    conv = dict(model.named_modules())[name]
    rows = augment(hand_patches(conv_inputs(model, pixels)[name], conv), conv.bias is not None)
    return rows.T @ rows


def collect(model: nn.Module, pixels: torch.Tensor, batch_size: int = 3) -> LayerStatistics:
    batches = [PixelBatch(pixels[i : i + batch_size]) for i in range(0, pixels.shape[0], batch_size)]
    return collect_statistics(model, batches, editable_layers(model))


def weights64(model: nn.Module, spec: LayerSpec) -> LayerWeights:
    module = dict(model.named_modules())[spec.name]
    bias = None if module.bias is None else module.bias.detach().double()
    return LayerWeights(module.weight.detach().double(), bias)


# ------------------------------------------------------------------------------ the unfold


@pytest.mark.parametrize("name", CONVS)
def test_the_hand_unfold_reproduces_each_conv(net: ConvNet, name: str) -> None:
    """The reference is right: its patches times the flat weight are the conv's own output."""
    conv = dict(net.named_modules())[name]
    x = conv_inputs(net, images(1, 2))[name]
    with torch.no_grad():
        expected = conv(x).double()  # the module's own float32 forward
    rows = augment(hand_patches(x, conv), conv.bias is not None) @ flat_weight(conv).T  # [B·L, C_out]
    positions = math.prod(expected.shape[2:])
    assert torch.allclose(rows.reshape(2, positions, -1).transpose(1, 2).reshape(expected.shape), expected, atol=1e-5)


@pytest.mark.parametrize("name", CONVS)
def test_layer_spec_and_weight_layout(net: ConvNet, name: str) -> None:
    conv = dict(net.named_modules())[name]
    spec = next(s for s in editable_layers(net) if s.name == name)
    assert spec.kernel is not None and spec.kernel.kind == ("conv1d" if isinstance(conv, nn.Conv1d) else "conv2d")
    assert spec.in_features == conv.in_channels * math.prod(conv.kernel_size)
    assert (spec.out_features, spec.bias) == (conv.out_channels, conv.bias is not None)
    assert list(spec.kernel.padding) == explicit_pads(conv)
    flat = weight_matrix(conv.weight.detach(), spec)
    assert torch.equal(flat, flat_weight(conv)[:, : spec.in_features].float())
    assert torch.equal(stored_weight(flat, spec), conv.weight.detach())


# ------------------------------------------------------------------------------ statistics


def test_collected_covariances_equal_the_hand_unfold(net: ConvNet) -> None:
    pixels = images(2, 7)
    stats = collect(net, pixels)
    inputs = conv_inputs(net, pixels)
    assert stats.lacking == []
    for name in CONVS:
        conv = dict(net.named_modules())[name]
        expected = reference_sum(net, pixels, name)
        assert rel(stats.sum_for(name), expected) < REL_TOL, name
        # the count is the output positions over every image
        outputs = hand_patches(inputs[name], conv).shape[0]
        assert stats.counts[stats.layer_group[name]] == outputs, name
    # one group for two convs unfolding one tensor alike, another for a 1x1 conv reading it
    assert stats.layer_group["twin"] == stats.layer_group["same"]
    assert stats.layer_group["pointwise"] != stats.layer_group["same"]
    assert "grouped" not in stats.layer_group


def test_a_conv1d_in_a_text_batch_counts_the_counted_tokens() -> None:
    """Token ids -> embeddings -> Conv1d over the sequence: the statistics hold exactly the patches
    at counted tokens (not prompt tokens, not pads)."""

    class TextConv(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(20, 4)
            self.conv = nn.Conv1d(4, 3, 3, padding=1)

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            return self.conv(self.embed(input_ids).transpose(1, 2))

    torch.manual_seed(3)
    model = TextConv().eval()
    ids = torch.randint(0, 20, (2, 6), generator=torch.Generator().manual_seed(4))
    counted = torch.tensor([[0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1]], dtype=torch.bool)
    batch = Batch(ids, torch.ones_like(ids), counted)
    stats = collect_statistics(model, [batch], editable_layers(model))
    x = model.embed(ids).detach().transpose(1, 2)
    rows = augment(hand_patches(x, model.conv), True)[counted.reshape(-1)]
    assert stats.counts[stats.layer_group["conv"]] == int(counted.sum())
    assert rel(stats.sum_for("conv"), rows.T @ rows) < REL_TOL


# ------------------------------------------------------------------------------ the edit


def reference_edit(w: torch.Tensor, sigma_f: torch.Tensor, sigma_r: torch.Tensor) -> torch.Tensor:
    """``[W | b] − α · [W | b] · Σ_f · (Σ_f + Σ_r)⁺`` in float64."""
    return w - ALPHA * w @ sigma_f.double() @ reference_pinv(sigma_f.double() + sigma_r.double())


def as_flat(edit: LayerEdit) -> torch.Tensor:
    w = edit.weight.double().reshape(edit.weight.shape[0], -1)
    return torch.cat([w, edit.bias.double()[:, None]], dim=1) if edit.bias is not None else w


@pytest.mark.parametrize("scaling", ["uniform", "weight_norm"])
def test_edit_equals_float64_reference(net: ConvNet, scaling: str) -> None:
    """The edited flat weight against the float64 algebra on the collected sums (the bars of
    test_compose), and end to end against the hand unfold's sums (the edit's bar: the float32
    products of collection, ~5e-8 of each sum, are amplified by the conditioning of ``Σ_U``, up to
    ~800 for the last Conv1d here, to ~2e-6 of the weight)."""
    forget_pixels, retain_pixels = images(5, 8), images(6, 16)
    forget, retain = collect(net, forget_pixels), collect(net, retain_pixels)
    layers = editable_layers(net)
    assert [s.name for s in layers] == list(EDITED)

    def load(spec: LayerSpec) -> LayerWeights:
        return weights64(net, spec)

    algebra = EngramAlgebra(terms=[(-ALPHA, forget)], universe=[forget, retain])
    scales = layer_scales(layers, algebra, load, scaling)  # type: ignore[arg-type]
    edits = {e.spec.name: e for e in layer_edits(layers, algebra, load, scales)}
    for name in CONVS:
        module = dict(net.named_modules())[name]
        edit, old = edits[name], flat_weight(module)
        assert edit.weight.shape == module.weight.shape, name
        f = edit.scale  # f_l as the service computed it (1 for uniform)
        assert scaling != "uniform" or f == 1.0
        on_sums = old + f * (reference_edit(old, forget.sum_for(name), retain.sum_for(name)) - old)
        assert rel(as_flat(edit), on_sums) < WEIGHT_TOL, name
        assert rel(as_flat(edit) - old, on_sums - old) < DELTA_TOL, name
        by_hand = reference_edit(old, reference_sum(net, forget_pixels, name), reference_sum(net, retain_pixels, name))
        end_to_end = old + f * (by_hand - old)
        assert rel(as_flat(edit) - old, end_to_end - old) < DELTA_TOL, name
    if scaling == "weight_norm":
        assert min(e.scale for e in edits.values()) < 0.9, "the schedule is not flat"


@pytest.mark.parametrize("kind", ["conv2d", "conv1d"])
def test_the_edited_conv_no_longer_responds_to_the_forget_inputs(kind: str) -> None:
    """Forget images live in channel 0, retain images in channels 1 and 2: their patches span
    orthogonal subspaces, so at α = 1 the edit is ``W · (I − P_forget)``. The edited conv answers
    the forget images with zeros and the retain images exactly as before."""
    torch.manual_seed(7)
    conv: nn.Conv1d | nn.Conv2d
    if kind == "conv2d":
        conv, shape = nn.Conv2d(3, 5, 3, stride=1, padding=1, bias=False), (3, 8, 8)
    else:
        conv, shape = nn.Conv1d(3, 5, 3, stride=2, padding=2, dilation=2, bias=False), (3, 40)

    class One(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = conv

        def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
            return self.conv(pixel_values)

    model = One().eval()
    forget, retain = images(8, 6, shape), images(9, 6, shape)
    forget[:, 1:] = 0.0
    retain[:, 0] = 0.0
    f_stats, r_stats = collect(model, forget), collect(model, retain)
    spec = editable_layers(model)[0]
    algebra = EngramAlgebra(terms=[(-1.0, f_stats)], universe=[f_stats, r_stats])
    (edit,) = layer_edits([spec], algebra, lambda s: weights64(model, s), {spec.name: 1.0})
    edited = type(conv)(**_conv_args(conv)).double()
    with torch.no_grad():
        edited.weight.copy_(edit.weight)
        before_forget, before_retain = conv(forget).double(), conv(retain).double()
        after_forget, after_retain = edited(forget.double()), edited(retain.double())
    assert float(before_forget.norm()) > 1.0
    assert float(after_forget.norm()) < 1e-6 * float(before_forget.norm())
    assert rel(after_retain, before_retain) < 1e-6


def _conv_args(conv: nn.Conv1d | nn.Conv2d) -> dict[str, Any]:
    return {
        "in_channels": conv.in_channels,
        "out_channels": conv.out_channels,
        "kernel_size": conv.kernel_size,
        "stride": conv.stride,
        "padding": conv.padding,
        "dilation": conv.dilation,
        "bias": conv.bias is not None,
    }


# ------------------------------------------------------------------------------ ai-engram


class HandUnfoldHandler(engram.LayerHandler):  # type: ignore[misc]
    """ai-engram's handler interface for a conv, flattening with this module's hand unfold."""

    def get_input_dim(self, module: nn.Module, absorb_bias: bool = False) -> int:
        return int(module.weight[0].numel()) + (1 if absorb_bias else 0)

    def reshape_input(self, module: nn.Module, inputs: Any, absorb_bias: bool = False) -> torch.Tensor:
        return augment(hand_patches(inputs[0], module), absorb_bias).float()

    def weight_matrix(self, module: nn.Module, absorb_bias: bool = False) -> torch.Tensor:
        w = module.weight.reshape(module.weight.shape[0], -1)
        return torch.cat([w, module.bias.reshape(-1, 1)], dim=1) if absorb_bias else w

    def to_weight_shape(self, w: torch.Tensor, module: nn.Module) -> torch.Tensor:
        return w.reshape(module.weight.shape)


def test_matches_ai_engram_with_a_conv_handler() -> None:
    torch.manual_seed(11)
    model = Sequential().eval()
    forget_pixels, retain_pixels = images(12, 6), images(13, 12)
    editor = engram.EngramEditor(model)
    editor.registry = {nn.Conv2d: HandUnfoldHandler(), nn.Conv1d: HandUnfoldHandler()}
    loader = [forget_pixels[:3], forget_pixels[3:]]
    theirs_forget = editor.collect_statistics(loader, batch_fn=lambda b: b)
    theirs_total = editor.collect_statistics([*loader, retain_pixels[:6], retain_pixels[6:]], batch_fn=lambda b: b)
    edited = editor.edit(theirs_forget, theirs_total, alpha=1.0)  # count_ratio: W − (n/N)·W·C_f·C_U⁺

    forget, retain = collect(model, forget_pixels), collect(model, retain_pixels)
    layers = editable_layers(model)
    algebra = EngramAlgebra(terms=[(-1.0, forget)], universe=[forget, retain])
    ours = {
        e.spec.name: e for e in layer_edits(layers, algebra, lambda s: weights64(model, s), {s.name: 1.0 for s in layers})
    }
    theirs = dict(edited.named_modules())
    assert set(ours) == {"stem", "dilated", "same", "seq"}
    for name, edit in ours.items():
        module = dict(model.named_modules())[name]
        old = flat_weight(module)
        their_delta = flat_weight(theirs[name]) - old
        assert float(their_delta.norm()) > 0, name
        assert rel(as_flat(edit) - old, their_delta) < ORACLE_TOL, name
        info_n = theirs_forget.count[name]
        assert info_n == forget.counts[forget.layer_group[name]], name


# ------------------------------------------------------------------------------ refused, and the layout


def test_convs_the_engine_cannot_edit_are_refused_by_name() -> None:
    class Standardized(nn.Conv2d):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            w = self.weight - self.weight.mean(dim=(1, 2, 3), keepdim=True)
            return F.conv2d(x, w, self.bias, self.stride, self.padding)

    model = nn.ModuleDict(
        {
            "grouped": nn.Conv2d(4, 6, 3, groups=2),
            "depthwise": nn.Conv2d(8, 8, 7, padding=3, groups=8),
            "reflect": nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect"),
            "volume": nn.Conv3d(2, 2, 3),
            "transposed": nn.ConvTranspose2d(2, 2, 3),
            "standardized": Standardized(3, 4, 3),
            "plain": nn.Conv2d(3, 4, 3),
        }
    )
    refused = refused_layers(model)
    assert set(refused) == {"grouped", "depthwise", "reflect", "volume", "transposed", "standardized"}
    assert "groups=2" in refused["grouped"]
    assert "groups=8 (depthwise)" in refused["depthwise"]
    assert "'reflect'" in refused["reflect"]
    assert "Conv3d" in refused["volume"] and "ConvTranspose2d" in refused["transposed"]
    assert "forward" in refused["standardized"]
    assert [s.name for s in editable_layers(model)] == ["plain"]
    assert conv_refusal(model["plain"]) is None


def test_layout_json_keeps_the_kernel_and_reads_older_layouts(net: ConvNet) -> None:
    layers = editable_layers(net)
    layout = ModelLayout("ConvNet", 1, layers, {}, {}, refused_layers=refused_layers(net))
    data = layout.to_json()
    entry = next(e for e in data["layers"] if e["name"] == "same")
    assert entry["kernel"] == {
        "kind": "conv2d",
        "in_channels": 5,
        "kernel_size": [2, 4],
        "stride": [1, 1],
        "padding": [[0, 1], [1, 2]],
        "dilation": [1, 1],
        "groups": 1,
    }
    assert "kernel" not in next(e for e in data["layers"] if e["name"] == "head")  # a Linear reads as before
    assert data["refused_layers"] == {"grouped": conv_refusal(net.grouped)}
    back = ModelLayout.from_json(data)
    assert back.layers == layers and back.refused_layers == layout.refused_layers
    assert isinstance(back.layer("same").kernel, ConvKernel)
    older = {key: value for key, value in data.items() if key != "refused_layers"}
    older["layers"] = [{k: v for k, v in e.items() if k != "kernel"} for e in data["layers"] if "kernel" not in e]
    assert ModelLayout.from_json(older).refused_layers == {}
    assert ModelLayout.from_json(older).layers[0].kernel is None


def test_an_adapter_refuses_a_dilated_conv_and_vllm_any_conv_by_name(net: ConvNet) -> None:
    """peft builds a conv's LoRA without its dilation; vLLM serves no conv LoRA: both refused naming
    the layer, before anything is written. An undilated conv factorizes for peft."""
    forget, retain = collect(net, images(14, 3)), collect(net, images(15, 6))
    algebra = EngramAlgebra(terms=[(-1.0, forget)], universe=[forget, retain])
    specs = {s.name: s for s in editable_layers(net)}

    def delta(name: str) -> LayerDelta:
        return next(layer_deltas([specs[name]], algebra, lambda s: weights64(net, s), {name: 1.0}))

    with pytest.raises(EditError, match=r'"peft" cannot carry the edit of layer dilated: .*dilation \[2, 1\]'):
        layer_lora(delta("dilated"))
    with pytest.raises(EditError, match=r'"vllm" cannot carry the edit of layer stem: vLLM serves no LoRA on a conv'):
        layer_lora(delta("stem"), lora_target="vllm")
    lora = layer_lora(delta("stem"))
    assert lora.kernel == specs["stem"].kernel and lora.lora_A.shape[1] == specs["stem"].in_features


def test_stored_engrams_apply_to_a_conv_as_the_algebra_edits_it(net: ConvNet) -> None:
    """A universe's stored engram ``E`` (``[out, in(+1)]``, float32) added to a float32 conv by
    ``apply_engrams`` (what a variant of a built universe does): the algebra's own edit, in the
    conv's stored shape."""
    forget, retain = collect(net, images(16, 4)), collect(net, images(17, 8))
    stored = EngramAlgebra(terms=[(1.0, forget)], universe=[forget, retain])
    direct = EngramAlgebra(terms=[(-ALPHA, forget)], universe=[forget, retain])
    modules = dict(net.named_modules())

    def load32(spec: LayerSpec) -> LayerWeights:
        module = modules[spec.name]
        return LayerWeights(module.weight.detach(), None if module.bias is None else module.bias.detach())

    for spec in (s for s in editable_layers(net) if s.kernel is not None):
        engram_e = stored.engram(spec, load32(spec)).float()
        edit = apply_engrams(spec, load32(spec), [(-ALPHA, engram_e)], 1.0)
        (expected,) = layer_edits([spec], direct, load32, {spec.name: 1.0})
        assert edit.weight.shape == modules[spec.name].weight.shape and edit.weight.dtype == torch.float32
        assert rel(as_flat(edit), as_flat(expected)) < WEIGHT_TOL, spec.name
