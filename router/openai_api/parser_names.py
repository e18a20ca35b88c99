"""The parsers a deployment's chat answers may be read with, by vLLM's names: what the configs
and the CLI accept, importable without the parsers themselves (the CLI starts in a blink).

Tool-call formats: router/openai_api/tool_formats.py (a reader each). Reasoning parsers: models
that think between <think> and </think> (router/openai_api/reasoning.py), each with where an
answer whose prompt says nothing starts: inside the thinking (the model may leave <think> out:
DeepSeek-R1, MiniMax-M2) or in the answer unless the model opens it (Qwen3, GLM-4.5,
DeepSeek-V3.1, whose templates open or close it at the prompt's end when thinking is set).
"""

TOOL_CALL_FORMATS = ("hermes", "qwen3_coder", "glm45", "llama3_json", "pythonic", "mistral")
TOOL_CALL_ALIASES = {"qwen3_xml": "qwen3_coder", "llama4_json": "llama3_json", "llama4_pythonic": "pythonic"}
TOOL_CALL_PARSERS = (*TOOL_CALL_FORMATS, *TOOL_CALL_ALIASES)

THINKS_FROM_THE_START = {"deepseek_r1": True, "minimax_m2": True, "qwen3": False, "glm45": False, "deepseek_v3": False}
REASONING_PARSERS = tuple(THINKS_FROM_THE_START)
