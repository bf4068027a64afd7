"""Ships umrt-activate.pth at the root of site-packages (pyproject alone cannot).

The .pth line imports umrt's start-up hook only when UMRT is set to an
enabling value, so `UMRT=1 python train.py` works with no code change.
Everything else about the package lives in pyproject.toml (the C++ sources umrt compiles
at first use, umrt/native/*.cpp, are its package data there).

Both install kinds get the file:

* ``pip install .`` builds a wheel: build_py copies the file to the root of
  build_lib, which becomes the wheel's (and so site-packages') root.
* ``pip install -e .`` (PEP 660) builds an editable wheel whose build_lib is
  thrown away; setuptools points the install command's install_lib at the
  unpacked editable wheel instead, so the file is written there. Should a
  setuptools ever change that, the .pth is missing and `umrt doctor` says so
  and names the fix (`python -m umrt.activation --install`).
"""
import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "umrt-activate.pth"


class build_py_with_pth(build_py):
    def run(self):
        super().run()
        self.copy_file(os.path.join("umrt", PTH), os.path.join(self._pth_dir(), PTH), preserve_mode=0)

    def _pth_dir(self):
        if getattr(self, "editable_mode", False):
            return self.get_finalized_command("install").install_lib
        return self.build_lib

    def get_outputs(self, include_bytecode=True):
        outputs = super().get_outputs(include_bytecode)
        if getattr(self, "editable_mode", False):
            return outputs  # the editable wheel holds it already; build_lib does not
        return outputs + [os.path.join(self.build_lib, PTH)]


setup(cmdclass={"build_py": build_py_with_pth})
