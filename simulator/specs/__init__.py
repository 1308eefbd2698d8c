"""What is simulated, as data: model architecture, GPU and calibration (efficiency) specs."""
