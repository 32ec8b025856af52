"""Ships two things setup.cfg cannot express: `mindmon-autoload.pth` into site-packages, and the
example YAMLs of `configs/` as `mindmon/configs/` (the demo's default config lives there)."""
import glob
import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
PTH = "mindmon-autoload.pth"


class BuildWithAutoload(build_py):
    def run(self):
        super().run()
        shutil.copy(os.path.join(HERE, PTH), os.path.join(self.build_lib, PTH))
        configs = os.path.join(self.build_lib, "mindmon", "configs")
        os.makedirs(configs, exist_ok=True)
        for path in glob.glob(os.path.join(HERE, "configs", "*.yaml")):
            shutil.copy(path, configs)

    def get_outputs(self, include_bytecode=1):
        extra = [os.path.join(self.build_lib, PTH)]
        extra += [os.path.join(self.build_lib, "mindmon", "configs", os.path.basename(p))
                  for p in glob.glob(os.path.join(HERE, "configs", "*.yaml"))]
        return super().get_outputs(include_bytecode) + extra


setup(cmdclass={"build_py": BuildWithAutoload})
