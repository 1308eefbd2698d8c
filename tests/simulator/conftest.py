import sys
from pathlib import Path

# sim_helpers.py sits next to the tests (no __init__.py in this folder)
sys.path.insert(0, str(Path(__file__).parent))
