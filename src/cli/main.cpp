// k3: the engine's command line (placeholder until the commands land).
#include <cstdio>
int main() { std::puts("k3"); return 0; }
