"""Inputs: the config schema, options, limits, files, model builders, the nn.Module importer, calibration."""
