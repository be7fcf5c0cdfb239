"""Shared test settings. Hypothesis runs the "ci" profile unless HYPOTHESIS_PROFILE names another."""

import os

from hypothesis import settings

settings.register_profile("ci", max_examples=200, deadline=None)
settings.register_profile("nightly", max_examples=10_000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
