// Command release packages the Helm chart as a release would publish it (make
// release-dry-run): charts/pd-extproc with the repository's version, and the
// image a registry would serve. It publishes nothing.
package main

import (
	"flag"
	"fmt"
	"os"

	"github.com/pd-extproc/pd-extproc/internal/chart"
)

func main() {
	version := flag.String("version", "", "the release's version (git describe): the chart's appVersion and image tag")
	image := flag.String("image", "", "the image repository the chart names, e.g. registry.example.com/pd-extproc")
	out := flag.String("out", "bin/release", "where the .tgz is written")
	flag.Parse()
	if *version == "" || *image == "" {
		fmt.Fprintln(os.Stderr, "release: -version and -image are required")
		os.Exit(2)
	}
	path, err := chart.Package(chart.Dir, *version, *image, *out)
	if err != nil {
		fmt.Fprintln(os.Stderr, "release:", err)
		os.Exit(1)
	}
	fmt.Printf("chart %s (version %s, image %s:%s)\n", path, chart.ChartVersion(*version), *image, *version)
}
