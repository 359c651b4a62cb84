"""The engine: autograd's saved-tensor hooks, the copies off the device and back, the host
arena, measured residency, and the accuracy guard for lossy plans. It uses ``planning`` and
``codecs``; nothing here imports the integrations or the commands."""
