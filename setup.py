"""Install fleet_ext. GPU users install the paddlepaddle-gpu build first (see README)."""

from setuptools import find_packages, setup

setup(
    name="fleet_ext",
    version="0.1.0",
    description="DeepSeek-V4-class model layers (DSv4 hybrid attention, DeepSeekMoE, mHC) for PaddlePaddle",
    python_requires=">=3.10",
    packages=find_packages(include=["fleet_ext", "fleet_ext.*"]),
    package_data={"fleet_ext": ["configs/*.yaml", "data/corpus/*.txt", "data/SOURCES.md"]},
    install_requires=[
        "paddlepaddle>=3.3",
        "PyYAML>=6.0",
        "numpy>=1.26",
        "safetensors>=0.4",
        "tqdm>=4.66",
        "matplotlib>=3.8",
    ],
    extras_require={
        "test": [
            "pytest>=8",
            "pytest-xdist>=3",
            "torch==2.13.0",
            "triton==3.6.0",
            "transformers==5.23.0",
            "safetensors>=0.4",
            "hypothesis>=6",
            "ruff>=0.6",
        ],
    },
    entry_points={"console_scripts": ["fleet-ext-demo=fleet_ext.demo:main"]},
)
