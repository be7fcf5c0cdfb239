"""kvferry: ``kvferry.common``, ``kvferry.prefill_worker`` and ``kvferry.decode_worker``.

Installed, those are this package's folders (``pyproject.toml`` maps each repository folder onto
its name). In a checkout run without installing (``PYTHONPATH=$PWD``, as ``bench/gpu_run.sh``
does), they are the repository's top-level folders: the checkout's root joins this package's path.
"""

from pathlib import Path as _Path

_HERE = _Path(__file__).resolve().parent
if not (_HERE / "common").is_dir() and (_HERE.parent / "common" / "cli.py").is_file():
    __path__.append(str(_HERE.parent))
