"""Settings are said once: every router setting can be set from the YAML under its own name,
and every YAML block and every dotted setting the README names is one the configuration takes."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from cluster.config import (
    ROUTER_PASS_THROUGH,
    ROUTER_SET_ELSEWHERE,
    AutoscalerSection,
    ClusterConfig,
    PoolConfig,
    PrefillPoolConfig,
    RouterSection,
    SpeculativeSection,
    load_config,
)
from engine.default_model_path import DEFAULT_MODEL_PATH
from router.config import RouterConfig

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()
SECTIONS = {"router": RouterSection, "prefill": PrefillPoolConfig, "decode": PoolConfig, "autoscaler": AutoscalerSection, "speculative": SpeculativeSection}


def test_every_router_setting_is_set_from_the_yaml_under_its_own_name_or_named_elsewhere():
    router_fields = {f.name for f in dataclasses.fields(RouterConfig)}
    assert set(ROUTER_PASS_THROUGH) <= set(RouterSection.model_fields), set(ROUTER_PASS_THROUGH) - set(RouterSection.model_fields)
    missing = router_fields - set(ROUTER_PASS_THROUGH) - set(ROUTER_SET_ELSEWHERE)
    assert not missing, f"RouterConfig fields no YAML setting reaches: {sorted(missing)}"
    spec = load_config(None, {"router.kv_lease_s": 17.5, "router.max_decode_restarts": 4, "router.router_lease_s": 11.0,
                               "router.model_sampling_defaults": False}).to_spec()
    assert (spec.router.kv_lease_s, spec.router.max_decode_restarts, spec.router.router_lease_s, spec.router.model_sampling_defaults) == (17.5, 4, 11.0, False)
    spec.router.validate()
    defaults = load_config(None, {}).to_spec().router
    for name in ROUTER_PASS_THROUGH:
        if name not in ("port", "admin_port", "http_port"):  # pdserve up listens on fixed ports; a bare RouterConfig on free ones
            assert getattr(defaults, name) == getattr(RouterConfig(), name), name


@pytest.mark.parametrize("dotted", sorted(set(re.findall(r"`((?:router|prefill|decode|autoscaler|speculative)\.[a-z_]+)", README))))
def test_every_setting_the_readme_names_exists(dotted):
    section, name = dotted.split(".")
    assert name in SECTIONS[section].model_fields, f"the README names {dotted}, which the configuration refuses"


def test_every_yaml_block_in_the_readme_loads(tmp_path):
    blocks = re.findall(r"```yaml\n(.*?)```", README, re.S)
    assert blocks
    for index, block in enumerate(blocks):
        # The README's files and model stand for the reader's own: made here.
        for name in re.findall(r"/etc/pdserve/([\w.]+)", block):
            (tmp_path / name).write_text("secret-token\n")
        block = block.replace("/etc/pdserve/", f"{tmp_path}/")
        block = re.sub(r"(?m)^model: \S+", f"model: {DEFAULT_MODEL_PATH}", block)
        path = tmp_path / f"block{index}.yaml"
        path.write_text(block)
        config = load_config(path, {})
        assert isinstance(config, ClusterConfig)
        config.to_spec()


def test_every_flag_of_pdserve_up_sets_a_field_the_configuration_has():
    from cluster.cli import build_parser, up_overrides

    args = build_parser().parse_args(["up"])
    for dotted in up_overrides(args):
        model = ClusterConfig
        *sections, name = dotted.split(".")
        for section in sections:
            model = SECTIONS[section]
        assert name in model.model_fields, f"a pdserve up flag sets {dotted}, which the configuration does not have"
