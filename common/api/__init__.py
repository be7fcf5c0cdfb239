"""The HTTP API shared by the prefill daemon, the decode daemon and a colocated server.

See README.md in this folder for the reading path and the exact request/response shapes.
"""

from kvferry.common.api.app import create_app
from kvferry.common.api.backend import Backend, BootstrapInfo, GenerateEvent, GenerateInput

__all__ = ["Backend", "BootstrapInfo", "GenerateEvent", "GenerateInput", "create_app"]
