"""Only what pyproject.toml cannot say: install ``luka_bench-lm_eval.pth`` into site-packages, in a normal and in
an editable install, so that ``lm_eval --model luka_bench`` finds the model with no import in user code
(lm-evaluation-harness reads no entry points; see luka_bench/lm_eval_plugin.py)."""
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "luka_bench-lm_eval.pth"
HERE = Path(__file__).resolve().parent


class build_py_with_pth(build_py):
    """A wheel (pip install .): the .pth goes to the root of the wheel, i.e. site-packages."""

    def run(self):
        super().run()
        self.copy_file(str(HERE / PTH), str(Path(self.build_lib) / PTH), preserve_mode=0)

    def get_outputs(self, include_bytecode=1):
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / PTH)]


cmdclass = {"build_py": build_py_with_pth}

try:  # an editable install (pip install -e .) builds its own wheel, without build_py's extra files
    from setuptools.command.editable_wheel import editable_wheel

    class _WithPth:
        """Wraps setuptools' editable strategy: writes the .pth into the editable wheel too."""

        def __init__(self, strategy):
            self.strategy = strategy

        def __call__(self, wheel, files, mapping):
            self.strategy(wheel, files, mapping)
            wheel.writestr(PTH, (HERE / PTH).read_bytes())

        def __enter__(self):
            self.strategy.__enter__()
            return self

        def __exit__(self, *exc):
            return self.strategy.__exit__(*exc)

    class editable_wheel_with_pth(editable_wheel):
        def _select_strategy(self, *args, **kwargs):
            return _WithPth(super()._select_strategy(*args, **kwargs))

    cmdclass["editable_wheel"] = editable_wheel_with_pth
except ImportError:  # setuptools < 64 has no PEP 660 editable wheels (pyproject asks for >= 68)
    pass

setup(cmdclass=cmdclass)
