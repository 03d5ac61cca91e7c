"""LiLiCorr from another architecture's export (`drafter.init_from`): the backbone of a DFlash export, or of
a DFlash2 export with the same block convolution (its selector left behind), the reranker head fresh;
any other export is refused before launch, naming the settings."""

import pytest
import torch

from dflash_ds.architectures import VARIANTS
from dflash_ds.config import DrafterConfig
from dflash_ds.config.errors import RecipeError
from dflash_ds.export import load_backbone, save_drafter
from dflash_ds.network.drafter import DFlashDrafter
from dflash_ds.resolve.drafter import drafter_shape
from dflash_ds.resolve.run import check_init_from
from tests.test_lilicorr import B, CONV, VOCAB, make_shape, pkg, target_config  # noqa: F401  (pkg: the fixture)

DFLASH2 = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4}


def export_of(tmp_path, architecture, fields=None, seed=3):
    sections = {architecture: VARIANTS[architecture].spec.fields(**fields)} if fields else {}
    shape = drafter_shape(target_config(), DrafterConfig(num_layers=2, block_size=B, mask_token_id=VOCAB - 1,
                                                         target_layer_ids=[1, 3, 5], architecture=architecture,
                                                         sections=sections))
    torch.manual_seed(seed)
    drafter = DFlashDrafter(shape)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return save_drafter(drafter, tmp_path / architecture, dtype=torch.float32), drafter


@pytest.mark.parametrize("architecture, fields, lilicorr", [("dflash", None, {}), ("dflash2", DFLASH2, CONV)])
def test_the_backbone_comes_from_the_export_and_the_head_starts_fresh(pkg, tmp_path, architecture, fields, lilicorr):
    path, source = export_of(tmp_path, architecture, fields)
    shape = make_shape(pkg, **lilicorr)
    check_init_from(str(path), shape)
    torch.manual_seed(7)
    got = load_backbone(path, shape, dtype=torch.float32).state_dict()
    torch.manual_seed(7)
    fresh = DFlashDrafter(shape).state_dict()
    theirs = source.state_dict()
    assert set(got) == set(fresh)
    backbone = [n for n in got if not n.startswith("lilicorr.")]
    assert len(backbone) > 10 and any("conv" in n for n in backbone) == bool(lilicorr)
    for n in backbone:
        assert torch.equal(got[n], theirs[n]), n
    for n in set(got) - set(backbone):
        assert torch.equal(got[n], fresh[n]), n
    assert not any(n.startswith("lilicorr.") for n in theirs)  # nothing of the head came from the export


@pytest.mark.parametrize("architecture, fields, lilicorr, named", [
    ("dflash2", DFLASH2, {}, "block_conv_kernel_size"),  # a DFlash2 backbone needs its convolution
    ("dflash", None, CONV, "dflash2 export"),  # a convolution the export does not have
    ("dflash2", {**DFLASH2, "conv_kernel_size": 3}, CONV, "conv_kernel_size / conv_group_size 3 / 16"),
    ("dspark", None, {}, "is a dspark export"),
])
def test_another_export_is_refused_naming_the_settings(pkg, tmp_path, architecture, fields, lilicorr, named):
    path, _ = export_of(tmp_path, architecture, fields)
    with pytest.raises(RecipeError) as err:
        check_init_from(str(path), make_shape(pkg, **lilicorr))
    assert named in str(err.value) and "drafter.init_from" in str(err.value) and "\n" not in str(err.value)


def test_a_backbone_of_another_width_is_refused_naming_the_setting(pkg, tmp_path):
    path, _ = export_of(tmp_path, "dflash")
    with pytest.raises(RecipeError, match="block_size"):
        check_init_from(str(path), drafter_shape(target_config(), DrafterConfig(
            num_layers=2, block_size=B + 4, mask_token_id=VOCAB - 1, target_layer_ids=[1, 3, 5], architecture="lilicorr",
            sections={"lilicorr": make_shape(pkg).arch_fields})))


@pytest.mark.parametrize("architecture", ["dflash", "lilicorr"])
def test_a_run_starts_from_a_backbone_or_continues_a_lilicorr_export_whole(pkg, tmp_path, architecture):
    from types import SimpleNamespace

    from dflash_ds.runtime.trainer import build_drafter

    shape = make_shape(pkg)
    if architecture == "lilicorr":
        torch.manual_seed(5)
        source = DFlashDrafter(shape)
        path = save_drafter(source, tmp_path / "lilicorr", dtype=torch.float32)
    else:
        path, source = export_of(tmp_path, architecture)
    recipe = SimpleNamespace(drafter=SimpleNamespace(init_from=str(path)), run=SimpleNamespace(seed=11))
    got = build_drafter(SimpleNamespace(recipe=recipe, drafter=shape, device=torch.device("cpu"))).state_dict()
    torch.manual_seed(11)
    fresh = DFlashDrafter(shape).state_dict()
    for n, t in got.items():
        want = source.state_dict()[n] if architecture == "lilicorr" or not n.startswith("lilicorr.") else fresh[n]
        assert torch.equal(t, want), n
