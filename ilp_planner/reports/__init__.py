"""Reports of plans: explain, summary, diff — pure strings built from plan data."""
