"""The one compiled part: the frame loop of the cold read path (``replaybuf/_native.c``).

Optional: where it does not compile, replaybuf installs without it and decodes frame by frame
through ctypes (``storage/_codecs.py``), slower on more than one core but the same bytes."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("replaybuf._native", ["replaybuf/_native.c"], optional=True)])
