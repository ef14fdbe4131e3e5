"""The module names of resumable-stream 0.x (before its sub-packages), still importable: code written against
``resumable_stream.checkpoint``, ``resumable_stream.trainer_patch``, ``python -m resumable_stream.llamafactory``
and the rest keeps working. Each old name is the new module itself (the same object, so patching either
patches both), found by a finder on ``sys.meta_path`` that :mod:`resumable_stream` installs.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys

MOVED = {
    'resumable_stream.arrow_pool': 'resumable_stream.runtime.arrow_pool',
    'resumable_stream.cache.warmup': 'resumable_stream.app.warmup',
    'resumable_stream.checkpoint': 'resumable_stream.state.checkpoint',
    'resumable_stream.checks': 'resumable_stream.state.checks',
    'resumable_stream.cli': 'resumable_stream.app.cli',
    'resumable_stream.collectives': 'resumable_stream.runtime.collectives',
    'resumable_stream.devices': 'resumable_stream.runtime.devices',
    'resumable_stream.growth': 'resumable_stream.dataset.growth',
    'resumable_stream.hub': 'resumable_stream.io.hub',
    'resumable_stream.index': 'resumable_stream.sources.index',
    'resumable_stream.job_source': 'resumable_stream.dataset.job_source',
    'resumable_stream.llamafactory': 'resumable_stream.integrations.llamafactory',
    'resumable_stream.llamafactory.callbacks': 'resumable_stream.integrations.llamafactory.callbacks',
    'resumable_stream.llamafactory.data': 'resumable_stream.integrations.llamafactory.data',
    'resumable_stream.llamafactory.processor': 'resumable_stream.integrations.llamafactory.processor',
    'resumable_stream.llamafactory.run': 'resumable_stream.app.llamafactory',
    'resumable_stream.llamafactory.settings': 'resumable_stream.integrations.llamafactory.settings',
    'resumable_stream.local_parquet': 'resumable_stream.sources.parquet_local',
    'resumable_stream.metrics': 'resumable_stream.observe.metrics',
    'resumable_stream.mindspore': 'resumable_stream.integrations.mindspore',
    'resumable_stream.mixture': 'resumable_stream.stream.mixture',
    'resumable_stream.mixture_state': 'resumable_stream.state.mixture_state',
    'resumable_stream.monitoring': 'resumable_stream.observe.monitoring',
    'resumable_stream.output_lock': 'resumable_stream.runtime.output_lock',
    'resumable_stream.overrides': 'resumable_stream.config.overrides',
    'resumable_stream.parquet_files': 'resumable_stream.sources.parquet_rows',
    'resumable_stream.partition': 'resumable_stream.stream.partition',
    'resumable_stream.prefetch': 'resumable_stream.sources.prefetch',
    'resumable_stream.progress': 'resumable_stream.observe.progress',
    'resumable_stream.prometheus': 'resumable_stream.observe.prometheus',
    'resumable_stream.ranged': 'resumable_stream.io.ranged',
    'resumable_stream.relocation': 'resumable_stream.state.relocation',
    'resumable_stream.report': 'resumable_stream.app.report',
    'resumable_stream.row_group_check': 'resumable_stream.sources.parquet_checks',
    'resumable_stream.run_dir': 'resumable_stream.state.checkpoint',
    'resumable_stream.safe_io': 'resumable_stream.io.safe_files',
    'resumable_stream.sidecar': 'resumable_stream.state.sidecar',
    'resumable_stream.sidecar_v1': 'resumable_stream.state.sidecar_v1',
    'resumable_stream.sources.net': 'resumable_stream.io.net',
    'resumable_stream.sources.registry': 'resumable_stream.config.formats',
    'resumable_stream.state_fields': 'resumable_stream.state.fields',
    'resumable_stream.stream_base': 'resumable_stream.stream.base',
    'resumable_stream.synthetic': 'resumable_stream.testing',
    'resumable_stream.threads': 'resumable_stream.runtime.threads',
    'resumable_stream.torch_compat': 'resumable_stream.runtime.torch_compat',
    'resumable_stream.trainer_patch': 'resumable_stream.integrations.transformers',
    'resumable_stream.trainer_patch.callbacks': 'resumable_stream.integrations.transformers.callbacks',
    'resumable_stream.trainer_patch.checkpoints': 'resumable_stream.integrations.transformers.checkpoints',
    'resumable_stream.trainer_patch.config': 'resumable_stream.config.trainer',
    'resumable_stream.trainer_patch.data_metrics': 'resumable_stream.integrations.transformers.data_metrics',
    'resumable_stream.trainer_patch.patch': 'resumable_stream.integrations.transformers.patch',
    'resumable_stream.trainer_patch.startup': 'resumable_stream.app.startup',
    'resumable_stream.trainer_patch.train': 'resumable_stream.app.train',
    'resumable_stream.transforms.config': 'resumable_stream.config.transforms',
}


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old module name and loads it as the new module (``MOVED``)."""

    def __init__(self) -> None:
        self._specs: dict = {}

    def find_spec(self, name, path=None, target=None):
        new = MOVED.get(name)
        if new is None:
            return None
        real = importlib.util.find_spec(new)     # not imported yet: ``python -m OLD_NAME`` runs it as __main__
        spec = importlib.machinery.ModuleSpec(name, self, is_package=real.submodule_search_locations is not None)
        if real.submodule_search_locations is not None:
            spec.submodule_search_locations = list(real.submodule_search_locations)
        return spec

    def create_module(self, spec):
        real = importlib.import_module(MOVED[spec.name])
        self._specs[spec.name] = real.__spec__
        return real

    def exec_module(self, module) -> None:
        # the import system set the old name's spec on the module: give it back its own
        module.__spec__ = self._specs.pop(module.__spec__.name)

    def get_code(self, name):
        """``python -m OLD_NAME`` (runpy) runs the new module as ``__main__``."""
        return compile(f"import runpy\nrunpy.run_module({MOVED[name]!r}, run_name='__main__', alter_sys=True)\n",
                       f"<{name}, moved to {MOVED[name]}>", "exec")


def install() -> None:
    if not any(isinstance(f, MovedModules) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedModules())   # before the path finder: an old package's old submodule
        # names must be these aliases, not second copies of the files found through the new package's path
