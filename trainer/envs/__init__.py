"""The task a run trains on: prompt sources (prompts.py), the environments that score and extend
episodes (environments.py), and the SWE environment with its sandboxes, grading and task files (swe_*.py)."""
