"""The deployment config's defaults as they reach the actors' engine configs."""

from __future__ import annotations

import pytest

from cluster.cli import build_parser
from cluster.config import ConfigError, load_config


def test_dtype_defaults_to_auto_and_reaches_both_pools_engines():
    spec = load_config(None, {}).to_spec()
    assert spec.prefill.engine.dtype == "auto" and spec.decode.engine.dtype == "auto"


@pytest.mark.parametrize("dtype", ["auto", "float32", "bfloat16"])
def test_the_dtype_flag_passes_through(dtype):
    args = build_parser().parse_args(["up", "--dtype", dtype])
    assert load_config(None, {"dtype": args.dtype}).to_spec().decode.engine.dtype == dtype


def test_a_null_dtype_means_the_checkpoints_and_a_bad_one_is_refused_by_name(tmp_path):
    config = tmp_path / "pdserve.yaml"
    config.write_text("dtype: null\n")
    assert load_config(config, {}).to_spec().decode.engine.dtype is None
    with pytest.raises(ConfigError, match="dtype"):
        load_config(None, {"dtype": "int8"})


@pytest.mark.parametrize(
    "config_text, message",
    [
        ("decode:\n  replicas: -1\n", "decode.replicas"),
        ("router:\n  routing_policy: fastest\n", "router.routing_policy"),
        ("bogus_field: 3\n", "bogus_field"),
        ("decode: [1, 2\n", "not valid YAML"),
        ("- a list\n", "the top level must be a mapping"),
        # Two listeners on one port: found only once Ray and the controller had started.
        ("router:\n  port: 8000\n", "router.http_port: 8000 is router.port too"),
        ("router:\n  metrics_port: 50052\n", "router.metrics_port: 50052 is router.admin_port too"),
        ("router:\n  http_host: 0.0.0.0\n  http_port: 9400\n  allow_unauthenticated: true\n", "router.metrics_port: 9400 is router.http_port too"),
    ],
)
def test_a_bad_config_file_is_refused_naming_the_field(tmp_path, config_text, message):
    """What `pdserve up --config` prints before it starts anything (tests/cluster/test_cli.py
    runs the command with two of these)."""
    config = tmp_path / "pdserve.yaml"
    config.write_text(config_text)
    with pytest.raises(ConfigError, match=message):
        load_config(config, {})


def test_a_model_directory_without_a_tokenizer_is_refused_before_anything_starts(tmp_path, e2e_model):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text((e2e_model.path / "config.json").read_text())
    with pytest.raises(ConfigError) as info:
        load_config(None, {"model": str(model)})
    assert "model" in str(info.value) and "no tokenizer.json" in str(info.value)


def test_a_model_the_engine_refuses_is_a_config_error_naming_it_not_a_traceback(tmp_path, e2e_model):
    """ModelLoadError is no ValueError: raised inside pydantic's validators it went through
    them, past the CLI's ConfigError handling, as a Python traceback from `pdserve up`."""
    import json
    import shutil

    model = tmp_path / "model"
    shutil.copytree(e2e_model.path, model)
    config = json.loads((model / "config.json").read_text())
    config.update(architectures=["GPTBigCodeForCausalLM"], model_type="gpt_bigcode")
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="model: .*GPTBigCode"):
        load_config(None, {"model": str(model)})


def test_a_section_left_empty_in_the_file_takes_the_flags_for_it(tmp_path):
    """``router:`` with every field commented out is null: a flag for it (--port) raised
    TypeError from the override, a traceback."""
    config = tmp_path / "pdserve.yaml"
    config.write_text("router:\n  # port: 50051\n")
    assert load_config(config, {"router.port": 50060}).router.port == 50060
    config.write_text("prefill: 2\n")
    with pytest.raises(ConfigError, match="prefill: must be a mapping"):
        load_config(config, {"prefill.replicas": 1})


def test_speculation_is_off_by_default_and_reaches_the_decode_pool_only_when_asked(tmp_path):
    assert load_config(None, {}).to_spec().decode.engine.speculative is None
    args = build_parser().parse_args(["up", "--speculative-method", "ngram", "--num-speculative-tokens", "3"])
    spec = load_config(None, {"speculative.method": args.speculative_method, "speculative.num_speculative_tokens": args.num_speculative_tokens}).to_spec()
    assert spec.prefill.engine.speculative is None, "prefill actors never decode"
    assert spec.decode.engine.speculative.method == "ngram" and spec.decode.engine.speculative.num_speculative_tokens == 3
    config = tmp_path / "pdserve.yaml"
    config.write_text("speculative:\n  prompt_lookup_min: 3\n  prompt_lookup_max: 2\n")
    with pytest.raises(ConfigError, match="speculative: .*prompt_lookup_min"):
        load_config(config, {})
    with pytest.raises(ConfigError, match="speculative.num_speculative_tokens"):
        load_config(None, {"speculative.num_speculative_tokens": 0})



def test_a_draft_model_without_a_method_runs_the_draft(e2e_model):
    """--draft-model alone left method at its default, ngram: the draft was never loaded, and
    nothing said so. It now means the draft_model method (as vLLM infers it), and a draft with
    method ngram is refused."""
    spec = load_config(None, {"speculative.draft_model": str(e2e_model.path)}).to_spec()
    assert spec.decode.engine.speculative.method == "draft_model" and spec.decode.engine.speculative.draft_model == str(e2e_model.path)
    with pytest.raises(ConfigError, match="draft_model: only the draft_model method"):
        load_config(None, {"speculative.draft_model": str(e2e_model.path), "speculative.method": "ngram"})


def test_the_kv_cache_dtype_reaches_both_pools_since_their_blocks_travel_between_them():
    assert load_config(None, {}).to_spec().prefill.engine.kv_cache_dtype == "auto"
    args = build_parser().parse_args(["up", "--kv-cache-dtype", "int8"])
    spec = load_config(None, {"kv_cache_dtype": args.kv_cache_dtype}).to_spec()
    assert spec.prefill.engine.kv_cache_dtype == spec.decode.engine.kv_cache_dtype == "int8"
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        load_config(None, {"kv_cache_dtype": "int4"})


def test_tensor_parallel_size_per_pool_from_flags_and_yaml(tmp_path):
    args = build_parser().parse_args(["up", "--prefill-tp", "1", "--decode-tp", "2"])
    spec = load_config(None, {"prefill.tensor_parallel_size": args.prefill_tp, "decode.tensor_parallel_size": args.decode_tp}).to_spec()
    assert (spec.prefill.engine.tensor_parallel_size, spec.decode.engine.tensor_parallel_size) == (1, 2)
    config = tmp_path / "pdserve.yaml"
    config.write_text("prefill: {tensor_parallel_size: 2}\n")
    spec = load_config(config, {}).to_spec()
    assert (spec.prefill.engine.tensor_parallel_size, spec.decode.engine.tensor_parallel_size) == (2, 1)


def test_a_tp_size_that_does_not_divide_the_heads_is_refused_naming_both_numbers():
    # The built-in model has 8 attention heads.
    with pytest.raises(ConfigError, match=r"decode.tensor_parallel_size: tensor_parallel_size 3 does not divide the model's 8 attention heads"):
        load_config(None, {"decode.tensor_parallel_size": 3})


def test_router_replicas_and_stream_interval_from_yaml_and_flags(tmp_path):
    config = tmp_path / "pdserve.yaml"
    config.write_text("router: {replicas: 3, stream_interval: 4}\n")
    spec = load_config(config, {}).to_spec()
    assert (spec.router_replicas, spec.router.stream_interval) == (3, 4)
    args = build_parser().parse_args(["up", "--router-replicas", "2", "--stream-interval", "1"])
    spec = load_config(config, {"router.replicas": args.router_replicas, "router.stream_interval": args.stream_interval}).to_spec()
    assert (spec.router_replicas, spec.router.stream_interval) == (2, 1)
    for bad in ({"router.replicas": 0}, {"router.stream_interval": 0}):
        with pytest.raises(ConfigError, match=list(bad)[0]):
            load_config(None, bad)


def test_startup_timeout_and_max_model_len_reach_the_deployment_and_a_too_long_one_is_refused(tmp_path, e2e_model):
    config = tmp_path / "pdserve.yaml"
    config.write_text(f"model: {e2e_model.path}\nstartup_timeout_s: 45\nmax_model_len: 300\n")
    spec = load_config(config, {}).to_spec()
    assert spec.startup_timeout_s == 45
    assert spec.prefill.engine.max_model_len == spec.decode.engine.max_model_len == 300
    config.write_text(f"model: {e2e_model.path}\nmax_model_len: 100000\n")
    with pytest.raises(ConfigError, match="max_model_len: 100000 exceeds the model's context"):
        load_config(config, {})


def test_the_node_probe_names_what_a_node_lacks(tmp_path):
    from cluster.node_check import _probe

    problems = _probe(str(tmp_path / "no-model-here"), "ray")
    assert len(problems) == 1 and problems[0].startswith(f"model {tmp_path / 'no-model-here'}: ")


def test_lora_modules_from_the_flag_and_yaml_reach_both_pools_and_the_router(tmp_path, e2e_model):
    from cluster.cli import up_overrides
    from cluster.deployment import model_info
    from tests.checkpoints import build_checkpoint, build_lora_adapter

    build_lora_adapter(e2e_model.hf_model, tmp_path / "sql", seed=1)
    args = build_parser().parse_args(["up", "--model", str(e2e_model.path), "--lora-modules", f"sql={tmp_path / 'sql'}"])
    spec = load_config(None, up_overrides(args)).to_spec()
    assert spec.prefill.engine.lora_adapters == spec.decode.engine.lora_adapters == {"sql": str(tmp_path / "sql")}
    assert model_info(spec).lora_adapters == {"sql": str(tmp_path / "sql")}
    config = tmp_path / "pdserve.yaml"
    config.write_text(f"model: {e2e_model.path}\nlora_modules:\n  sql: {tmp_path / 'sql'}\n")
    assert load_config(config, {}).to_spec().decode.engine.lora_adapters == {"sql": str(tmp_path / "sql")}

    with pytest.raises(SystemExit):  # argparse names the malformed value
        build_parser().parse_args(["up", "--lora-modules", "no-path-given"])
    # Refused before any actor starts, naming the adapter: another model's, a missing one, the base's name.
    other = build_checkpoint("llama", tmp_path / "other", hidden_size=96)
    build_lora_adapter(other, tmp_path / "other_lora", seed=1)
    with pytest.raises(ConfigError, match="lora_modules.other: .*another model"):
        load_config(None, {"model": str(e2e_model.path), "lora_modules": {"other": str(tmp_path / "other_lora")}})
    with pytest.raises(ConfigError, match="lora_modules.gone: .*does not exist"):
        load_config(None, {"model": str(e2e_model.path), "lora_modules": {"gone": str(tmp_path / "gone")}})
    with pytest.raises(ConfigError, match="lora_modules: 'tiny' is not a usable adapter name"):
        load_config(None, {"model": str(e2e_model.path), "router.served_model_names": ["tiny"], "lora_modules": {"tiny": str(tmp_path / "sql")}})
    # A comma split one adapter into two in the lora_requests_info metric's lists (as a runtime load's name is refused).
    with pytest.raises(ConfigError, match="lora_modules: 'sql,v2': must be at most 256 printable characters without commas"):
        load_config(None, {"model": str(e2e_model.path), "lora_modules": {"sql,v2": str(tmp_path / "sql")}})
    # vLLM's --max-lora-rank reaches both pools (--max-loras and --enable-lora are taken); an adapter past it is refused here.
    bounded = build_parser().parse_args(["up", "--model", str(e2e_model.path), "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
                                         "--lora-modules", f"sql={tmp_path / 'sql'}"])
    spec = load_config(None, up_overrides(bounded)).to_spec()
    assert {pool.engine.max_lora_rank for pool in (spec.prefill, spec.decode)} == {8}
    with pytest.raises(ConfigError, match="lora_modules.sql: the adapter's rank 8 is above max_lora_rank = 4"):
        load_config(None, {"model": str(e2e_model.path), "max_lora_rank": 4, "lora_modules": {"sql": str(tmp_path / "sql")}})
    with pytest.raises(ConfigError, match="lora_modules.gone: .*does not exist"):  # (a clean refusal beside the bound too)
        load_config(None, {"model": str(e2e_model.path), "max_lora_rank": 4, "lora_modules": {"gone": str(tmp_path / "gone")}})


def test_runtime_lora_updating_from_the_flag_and_only_with_one_router():
    from cluster.cli import up_overrides

    assert load_config(None, {}).to_spec().router.allow_runtime_lora_updating is False
    args = build_parser().parse_args(["up", "--allow-runtime-lora-updating"])
    assert load_config(None, up_overrides(args)).to_spec().router.allow_runtime_lora_updating is True
    with pytest.raises(ConfigError, match="router.allow_runtime_lora_updating: needs router.replicas 1"):
        load_config(None, {"router.allow_runtime_lora_updating": True, "router.replicas": 2})


def test_the_reasoning_parser_and_max_model_len_from_flags_and_a_bad_parser_named():
    from cluster.cli import up_overrides

    args = build_parser().parse_args(["up", "--reasoning-parser", "qwen3", "--max-model-len", "300"])
    spec = load_config(None, up_overrides(args)).to_spec()
    assert spec.router.reasoning_parser == "qwen3" and spec.decode.engine.max_model_len == 300
    with pytest.raises(ConfigError, match="router.reasoning_parser"):
        load_config(None, {"router.reasoning_parser": "harmony"})


def test_a_chat_template_from_a_file_or_inline_and_its_default_kwargs(tmp_path):
    from cluster.cli import up_overrides

    template = tmp_path / "tool_chat.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    args = build_parser().parse_args(["up", "--chat-template", str(template), "--default-chat-template-kwargs", '{"enable_thinking": false}'])
    router = load_config(None, up_overrides(args)).to_spec().router
    assert router.chat_template == template.read_text() and router.default_chat_template_kwargs == {"enable_thinking": False}
    assert load_config(None, {"router.chat_template": "{{ messages }}"}).to_spec().router.chat_template == "{{ messages }}"
    with pytest.raises(ConfigError, match="router.chat_template"):
        load_config(None, {"router.chat_template": str(tmp_path / "missing.jinja")})
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--default-chat-template-kwargs", "[1]"])


def test_more_actors_than_cores_on_one_machine_share_them():
    """`pdserve up --prefill 2 --decode 2` on a 2-core host reserved a core per actor: Ray could
    place two, and `up` waited out the start-up timeout (300 s) for the others. More actors than
    cores now take a fraction each (one torch thread); fewer keep whole cores."""
    crowded = load_config(None, {"prefill.replicas": 2, "decode.replicas": 2})
    crowded.share_local_cores(2)
    spec = crowded.to_spec()
    assert (spec.prefill.num_cpus, spec.decode.num_cpus) == (0.5, 0.5)
    assert spec.prefill.replicas * spec.prefill.num_cpus + spec.decode.replicas * spec.decode.num_cpus <= 2
    assert spec.decode.engine.num_threads == 1
    roomy = load_config(None, {"prefill.replicas": 1, "decode.replicas": 1})
    roomy.share_local_cores(8)
    assert roomy.to_spec().decode.num_cpus == 4.0 and roomy.to_spec().decode.engine.num_threads == 4


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"router.kv_lease_s": 10}, "router.kv_lease_s: .*must exceed the KV write timeout"),
        ({"router.served_model_names": []}, "served_model_names"),
    ],
)
def test_settings_the_deployment_refuses_are_refused_before_anything_starts(overrides, message):
    """These passed the config and failed only once a Ray head and the controller had started
    (DeploymentSpec.validate, the engines' own checks)."""
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_a_thread_ceiling_below_the_shared_cores_caps_the_threads():
    """max_threads 2 on a host whose shared cores gave an actor 4 threads: the worker failed to
    start on "max_num_threads", a field the user never set."""
    config = load_config(None, {"decode.max_threads": 2, "prefill.replicas": 1})
    config.share_local_cores(8)
    assert config.to_spec().decode.engine.num_threads == 2


def test_one_port_on_two_addresses_is_two_listeners():
    """Only one port on the same address (or on every address) clashes."""
    from cluster.config import RouterSection

    section = RouterSection(host="127.0.0.2", port=9000, http_host="127.0.0.1", http_port=9000)
    assert (section.port, section.http_port) == (9000, 9000)
    for host, other in (("localhost", "127.0.0.1"), ("[::1]", "::1"), ("localhost", "::1")):  # one address, written two ways
        with pytest.raises(ValueError, match="router.http_port: 9000 is router.port too"):
            RouterSection(host=host, port=9000, http_host=other, http_port=9000)


def test_vllm_serve_flags_set_what_their_names_say():
    """A vLLM command line works as written: --host binds both the gRPC and the OpenAI API (the
    OpenAI API stayed on loopback while gRPC was exposed), --enable-prefix-caching is taken as well
    as its --no- form, and vLLM's names set the engines' sizes for both pools."""
    from cluster.cli import up_overrides

    args = build_parser().parse_args([
        "up", "--host", "0.0.0.0", "--enable-prefix-caching", "--tensor-parallel-size", "2", "--max-num-seqs", "8",
        "--max-num-batched-tokens", "256", "--gpu-memory-utilization", "0.8",
    ])
    config = load_config(None, {**up_overrides(args), "router.allow_unauthenticated": True})
    assert (config.router.host, config.router.http_host) == ("0.0.0.0", "0.0.0.0")
    spec = config.to_spec()
    for pool in (spec.prefill, spec.decode):
        assert pool.engine.enable_prefix_caching and pool.engine.tensor_parallel_size == 2 and pool.engine.max_num_seqs == 8
        assert pool.engine.max_num_batched_tokens == 256
    assert config.gpu_memory_utilization == 0.8
    per_pool = build_parser().parse_args(["up", "--tensor-parallel-size", "2", "--prefill-tp", "1", "--no-enable-prefix-caching"])
    spec = load_config(None, up_overrides(per_pool)).to_spec()
    assert (spec.prefill.engine.tensor_parallel_size, spec.decode.engine.tensor_parallel_size) == (1, 2)
    assert not spec.decode.engine.enable_prefix_caching


def test_a_section_left_empty_in_the_file_is_its_defaults(tmp_path):
    """``router:`` with every key commented out was refused as no mapping, unless a flag wrote
    into it; the README says every field is optional."""
    config = tmp_path / "pdserve.yaml"
    config.write_text("router:\n  # port: 50051\ndecode:\nprefill:\n")
    loaded = load_config(config, {})
    assert loaded.router.port == load_config(None, {}).router.port
    assert loaded.decode.replicas == load_config(None, {}).decode.replicas
