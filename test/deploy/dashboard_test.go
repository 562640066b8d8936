package deploy

import (
	"encoding/json"
	"testing"

	"github.com/pd-extproc/pd-extproc/internal/testbed"
)

// dashboardPanel is a panel of the dashboard, rows among them, as Grafana places it.
type dashboardPanel struct {
	ID          int
	Type, Title string
	GridPos     struct{ H, W, X, Y int }
}

func dashboardPanels(t *testing.T) []dashboardPanel {
	t.Helper()
	var d struct{ Panels []dashboardPanel }
	if err := json.Unmarshal(mustRead(t, testbed.MustRepoPath(t, dashboardFile)), &d); err != nil {
		t.Fatal(err)
	}
	if len(d.Panels) < 30 {
		t.Fatalf("%d panels in %s: the file changed shape", len(d.Panels), dashboardFile)
	}
	return d.Panels
}

// Every panel has an id of its own and a place on the 24-column grid that no other panel takes
// (Grafana moves overlapping panels wherever it finds room).
func TestDashboardPanelsDoNotOverlap(t *testing.T) {
	panels := dashboardPanels(t)
	ids := map[int]string{}
	for i, p := range panels {
		g := p.GridPos
		if other, dup := ids[p.ID]; dup {
			t.Errorf("panels %q and %q both have id %d", other, p.Title, p.ID)
		}
		ids[p.ID] = p.Title
		if g.W <= 0 || g.H <= 0 || g.X < 0 || g.Y < 0 || g.X+g.W > 24 {
			t.Errorf("panel %q at %+v is off the 24-column grid", p.Title, g)
		}
		for _, q := range panels[:i] {
			h := q.GridPos
			if g.X < h.X+h.W && h.X < g.X+g.W && g.Y < h.Y+h.H && h.Y < g.Y+g.H {
				t.Errorf("panel %q at %+v overlaps %q at %+v", p.Title, g, q.Title, h)
			}
		}
	}
}
