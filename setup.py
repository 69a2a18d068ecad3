"""The build's one check beyond setup.cfg (which holds everything else): a wheel or an sdist must
hold the ledger page's chart library. It is not in the clone (sage_access/web/node_modules is
filled by `make web` from package-lock.json), and without it setup.cfg's package_data silently
matches nothing: the wheel built, and `sage-tfx ledger serve` then refused to start. So the build
stops, saying how to get it. An editable install (`pip install -e .`, which `make` runs before
`make web`) serves the files from the clone and is not checked."""
import os

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = os.path.dirname(os.path.abspath(__file__))
# The files setup.cfg's package_data takes from node_modules (app.chart_library serves them).
CHART_LIBRARY = [os.path.join("sage_access", "web", "node_modules", "plotly.js-basic-dist-min",
                              name)
                 for name in ("package.json", "plotly-basic.min.js", "LICENSE")]


def require_chart_library() -> None:
    missing = [path for path in CHART_LIBRARY if not os.path.isfile(os.path.join(HERE, path))]
    if missing:
        raise SystemExit(
            f"error: the ledger page's chart library is missing ({', '.join(missing)}), so the "
            "package would install without it and `sage-tfx ledger serve` would not start. Run "
            "`make web` (npm ci in sage_access/web, versions pinned in its package-lock.json) "
            "in the clone, then build again.")


class BuildPy(build_py):
    def run(self):
        if not self.editable_mode:
            require_chart_library()
        super().run()

    def find_package_modules(self, package, package_dir):
        # The repository root is the sage_tfx package (setup.cfg): this file is not part of it.
        return [module for module in super().find_package_modules(package, package_dir)
                if (module[0], module[1]) != ("sage_tfx", "setup")]


class Sdist(sdist):
    def run(self):
        require_chart_library()
        super().run()


setup(cmdclass={"build_py": BuildPy, "sdist": Sdist})
