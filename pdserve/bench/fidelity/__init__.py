"""The planner's calibration lab: fidelity runs against real clusters, stored runs and their
step traces, and the CPU corrections fitted from them (``pdserve bench fidelity``)."""
