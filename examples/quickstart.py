"""Where the memory of one training step goes, measured on CPU with MemoryTracker.

Run: python examples/quickstart.py
"""

import torch

from lightning_memopt.memory import CATEGORIES, MemoryTracker, format_bytes


def main() -> None:
    torch.manual_seed(0)
    model = torch.nn.TransformerEncoder(
        torch.nn.TransformerEncoderLayer(128, 4, 512, dropout=0.0, batch_first=True), num_layers=4
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(16, 128, 128)  # (B, T, C)
    with MemoryTracker(model, optimizer) as tracker:
        for _ in range(3):
            loss = model(x).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    print(f"peak live tensor bytes over 3 steps: {format_bytes(tracker.peak)}")
    for category in CATEGORIES:
        print(f"  {category:<16} {format_bytes(tracker.peak_breakdown[category]):>12}")


if __name__ == "__main__":
    main()
