"""splitserve.control_plane."""
