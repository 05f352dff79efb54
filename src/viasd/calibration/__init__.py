"""Calibration of VIA-SD for one model pair on this machine: slim-view search, costs, gate records, replay and
selection of the round policy, assembled into a routing profile by `pipeline.calibrate_pair`."""
