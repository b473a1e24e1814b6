"""The typed plan, its check, its audit and its programs: a leaf above the lowering that imports
no planner, report or runtime module."""
