"""Loads a script of tests/gpu as a module, for the CPU tests of its host-side logic (the scripts
are not a package: they run as scripts on the GPU machine)."""
import importlib.util
import pathlib
import sys


def load(name: str):
  path = pathlib.Path(__file__).parent / "gpu" / f"{name}.py"
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module  # dataclasses look their module up there
  spec.loader.exec_module(module)
  return module
