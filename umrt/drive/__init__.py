"""Drive: the one loop that feeds events to a policy, its layout and a backend
(:class:`Driver`), and the sources that hand it events."""
from umrt.drive.driver import Driver

__all__ = ["Driver"]
