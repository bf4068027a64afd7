"""Ships umrt-activate.pth at the root of site-packages (pyproject alone cannot).

The .pth line imports umrt's start-up hook only when UMRT is set to an
enabling value, so `UMRT=1 python train.py` works with no code change.
Everything else about the package lives in pyproject.toml.
"""
import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "umrt-activate.pth"


class build_py_with_pth(build_py):
    def run(self):
        super().run()
        self.copy_file(os.path.join("umrt", PTH), os.path.join(self.build_lib, PTH), preserve_mode=0)

    def get_outputs(self, include_bytecode=True):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, PTH)]


setup(cmdclass={"build_py": build_py_with_pth})
