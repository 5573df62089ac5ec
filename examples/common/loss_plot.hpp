// The examples' loss plots: a CSV's columns drawn into a PNG by gnuplot (Debian: gnuplot-nox),
// when it is installed. Header-only, for the examples (not part of the library).
#pragma once

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <sstream>
#include <string>

namespace examples {

/// Whether a gnuplot is on PATH.
inline bool gnuplot_available() {
  const char* path = std::getenv("PATH");
  if (path == nullptr) return false;
  std::stringstream ss(path);
  std::string dir;
  while (std::getline(ss, dir, ':'))
    if (!dir.empty() && ::access((dir + "/gnuplot").c_str(), X_OK) == 0) return true;
  return false;
}

/// Draws `png` (800x500) with gnuplot: `settings` (labels, title, scales; each line ending in
/// '\n') then `plot` (a plot command reading the CSV, '%s' standing for its path, comma-separated,
/// a header line skipped by the caller's `skip 1`). Returns "" when the PNG was written, else why
/// not. A picture left by an earlier run is removed first, so a PNG there is always this run's.
inline std::string plot_csv(const std::string& csv, const std::string& png, const std::string& settings,
                            const std::string& plot) {
  if (!gnuplot_available()) return "gnuplot is not installed (Debian: apt-get install gnuplot-nox)";
  std::error_code ec;
  std::filesystem::remove(png, ec);
  FILE* gp = ::popen("gnuplot >/dev/null 2>&1", "w");  // a PNG it cannot write would go to stdout
  if (gp == nullptr) return "gnuplot could not be started";
  std::string command = plot;
  for (std::size_t at = command.find("%s"); at != std::string::npos; at = command.find("%s", at + csv.size()))
    command.replace(at, 2, csv);
  std::fprintf(gp, "set terminal png size 800,500\nset output '%s'\nset datafile separator ','\n%s%s\n", png.c_str(),
               settings.c_str(), command.c_str());
  if (::pclose(gp) != 0 || !std::filesystem::exists(png)) return "gnuplot failed to write the PNG";
  return "";
}

}  // namespace examples
