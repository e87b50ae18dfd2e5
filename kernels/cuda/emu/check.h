// check.h: the report of an emulation test (included after its generated source): `chk` prints
// one comparison's error and keeps the worst, `finish` prints the worst and gives the exit code.
#include <cmath>
#include <cstdio>
static double worst = 0;
static void chk(const char *what, double e) {
    printf("%s: max abs err %.3g\n", what, e);
    worst = std::max(worst, std::isnan(e) ? INFINITY : e);
}
static int finish(double tol) {
    printf("worst %.3g\n", worst);
    return worst < tol ? 0 : 1;
}
