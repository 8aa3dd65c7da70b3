"""Development fixtures: an offline dummy-weight model directory (`tiny_model`) for vLLM and the simulator."""
