import os
import sys

# Make tests/ helpers (dion3_reference) importable and keep the repo root first on the path.
sys.path.insert(0, os.path.dirname(__file__))
