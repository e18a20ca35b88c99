"""Where the project's own small default model ships, inside the engine package."""

import pathlib

DEFAULT_MODEL_PATH = pathlib.Path(__file__).parent / "default_model"
